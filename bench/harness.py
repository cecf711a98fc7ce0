"""Fair peer comparisons (DESIGN.md section 6): every side runs alone, in processes of its own,
with its own default settings; sides alternate for several rounds; the result is the median of
the per-round ratios and their spread.

A benchmark script is both the driver and the side: run without ``--side`` it starts itself
once per side and round (``side_command``), each child prints one ``BENCH {json}`` line
(``report``) and the driver compares. Why not one process timing both: measured here, PyTorch
next to raf_dist in one process ran 2.5-25x slower than alone (spinning or pinned thread
pools), and an environment variable chosen for one side (OMP_WAIT_POLICY=PASSIVE) slows the
other.

Same cores for both sides: ``--cores K`` runs every child on the first K cores the driver may
use (its affinity mask); each side then sizes its thread pools by its own defaults.
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
_TAG = "BENCH "


def report(result: dict) -> None:
    """Print one side's result for the driver (the only line it parses)."""
    print(_TAG + json.dumps(result), flush=True)


def median_ms(fn, steps: int, warmup: int = 3, timer=None) -> float:
    """Median wall time of ``fn()`` in ms over ``steps`` calls after ``warmup`` calls.
    ``timer(fn)`` may replace the plain clock (the data-parallel benches time the slowest rank)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        if timer is not None:
            times.append(timer(fn))
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def median_wall_cpu_ms(fn, steps: int, warmup: int = 3) -> dict:
    """``median_ms`` and, beside it, the median CPU time of this process per call (every
    thread's, ``time.process_time``) and the share of the machine's time the hypervisor
    stole meanwhile (/proc/stat's steal column; 0 where absent). On a shared VM the wall
    time of one process varies by tens of percent from one run to the next; the CPU time
    the work took and the steal say whether a ratio moved with the work or the machine."""
    for _ in range(warmup):
        fn()
    walls, cpus = [], []
    before = _cpu_ticks()
    for _ in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    after = _cpu_ticks()
    total = sum(after) - sum(before)
    steal = (after[7] - before[7]) / total if total > 0 and len(after) > 7 else 0.0
    return {"ms": statistics.median(walls) * 1e3, "cpu_ms": statistics.median(cpus) * 1e3,
            "steal": steal}


#: the PyTorch peers a bench may run (``--peer``): eager, or torch.compile (Inductor) on the
#: module and on the optimizer's step, PyTorch's recipe for a compiled training step
PEERS = ("eager", "compile")


def torch_peer_step(module, opt, loss_of, peer: str):
    """(step, first loss, first step's seconds) of PyTorch's training step on ``peer``:
    ``loss_of(module)`` gives the loss; ``step()`` zeroes the gradients, runs forward and
    backward, updates, and returns the loss. Under "compile" the module is ``torch.compile``d
    and ``opt.step`` compiled too. The first step runs here, outside any timing: under
    "compile" its seconds are Inductor's compile (cold on a new cache, warm when an earlier
    process filled it)."""
    import torch

    if peer not in PEERS:
        raise SystemExit(f"--peer must be one of {PEERS}, got {peer!r}")
    update = opt.step
    if peer == "compile":
        module = torch.compile(module)
        update = torch.compile(opt.step)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(module)
        loss.backward()
        update()
        return loss.item()

    start = time.perf_counter()
    first = step()
    return step, first, time.perf_counter() - start


def _cpu_ticks() -> list[int]:
    """The machine's CPU time counters (the first line of /proc/stat; [] where absent)."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return []


def mpiexec() -> str:
    """The launcher the project's Makefile uses: the mpich wheel's in the venv, else the system's."""
    venv = Path(sys.executable).parent / "mpiexec"
    return str(venv) if venv.exists() else "mpiexec"


#: hydra's flag binding each rank to one core, round-robin (Open MPI's needs
#: ``--bind-to core:overload-allowed`` with more ranks than cores): with more ranks
#: than cores, unbound ranks' steps swung 2x from job to job here (bench/RESULTS.md, "Steady
#: steps"); a cluster's launcher binds a rank to its device's cores the same way
BIND = ["--bind-to", "core"]


def cores(count: int | None) -> set[int] | None:
    """The first ``count`` cores of the driver's affinity mask (None: all of them)."""
    mine = sorted(os.sched_getaffinity(0))
    if count is None:
        return None
    if not 1 <= count <= len(mine):
        raise SystemExit(f"--cores {count}: this process may use {len(mine)} cores ({mine})")
    return set(mine[:count])


def run_side(argv: list[str], cpu_set: set[int] | None = None, timeout: float = 900,
             env: dict | None = None) -> dict:
    """Run one side to completion in a process session of its own; returns its BENCH result.
    ``env`` entries are added to the driver's environment (never settings that favour a side)."""
    def confine():
        if cpu_set is not None:
            os.sched_setaffinity(0, cpu_set)

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, preexec_fn=confine, start_new_session=True,
                            env=dict(os.environ, **(env or {})))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session started above, nothing else
        out, _ = proc.communicate()
        raise SystemExit(f"{' '.join(argv)} did not finish in {timeout} s:\n{out}")
    lines = [line[len(_TAG):] for line in out.splitlines() if line.startswith(_TAG)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{out}")
    return json.loads(lines[-1])


def alternate(sides: dict[str, list[str]], rounds: int, cpu_set: set[int] | None = None,
              log=print) -> dict[str, list[dict]]:
    """Run every side once per round, in turn, ``rounds`` times; results by side, in round order."""
    results = {name: [] for name in sides}
    for index in range(rounds):
        for name, argv in sides.items():
            result = run_side(argv, cpu_set)
            results[name].append(result)
            log(f"# round {index + 1}/{rounds} {name}: {json.dumps(result)}")
    return results


def ratio_summary(ours: list[float], peer: list[float]) -> tuple[float, float, float]:
    """Median, min and max of the per-round ratios ours / peer (< 1: ours is faster)."""
    ratios = [a / b for a, b in zip(ours, peer)]
    return statistics.median(ratios), min(ratios), max(ratios)


def format_ratio(ours: list[float], peer: list[float]) -> str:
    median, low, high = ratio_summary(ours, peer)
    return f"{median:5.2f} [{low:.2f}-{high:.2f}]"


def machine() -> str:
    """One line naming the machine, for the tables in bench/RESULTS.md."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # not Linux: the model name is only a label
    return f"{model}, {len(os.sched_getaffinity(0))} cores usable, {time.strftime('%Y-%m-%d')}"
