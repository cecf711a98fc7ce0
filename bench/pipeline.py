"""Pipeline parallelism: bubble and step time of gpipe vs 1f1b vs interleaved_1f1b (the GPT of
bench/step_time.py: 4 layers, d=128, 4 heads, seq 64, vocab 512, batch 16; Adam).

    python bench/pipeline.py [--pp 2,4] [--microbatches 1,2,4,8] [--steps 5]
                             [--schedules gpipe,1f1b,interleaved_1f1b] [--timeout 1200]

One ``mpiexec -n P`` job per (P, schedule), pipeline_parallel_size = P (no data or tensor
parallelism: every rank passes the whole batch), running every M inside it: per M a new
Trainer (num_microbatches = M; interleaved_1f1b with 2 stages per rank and only where M is a
multiple of P), 2 warm-up steps, then ``--steps`` timed steps, each started after a barrier
and timed on the slowest rank. Printed per (P, schedule, M):

- step ms: median over the timed steps (slowest rank);
- measured bubble: per step, each rank's idle share ``1 - (sum of its F/B durations in
  trainer.last_timeline) / span``, ``span`` the wall time from the earliest F/B start to the
  latest F/B end over all ranks (the timelines are gathered to rank 0; every rank is on this
  machine, so time.perf_counter is one clock), averaged over the ranks, median over the steps.
  The update, the loss broadcast and the finiteness allreduce are outside the span;
- ideal: the textbook ``(P-1) / (M*v + P-1)`` (v = 1, or 2 interleaved);
- peak activation bytes per stage: ``stats()["pipeline"]["peak_saved_bytes"]`` of the rank
  holding the stage (the values kept for the backward of the microbatches in flight).

The batch stays 16 rows when M divides it, else the next multiple of M. On a 2-core machine
P = 4 oversubscribes the cores (4 ranks on 2 cores): a rank waiting for a message competes for
a core with ranks that compute, so the measured bubbles there include time-sharing and are
not the schedule's alone; P = 2 runs one rank per core. Stage compute is small (a few ms), so
message latency and Python dispatch weigh more than on a real pipeline.

Every job runs under a hard timeout (``--timeout`` seconds, killed with its process group;
mpiexec also gets MPIEXEC_TIMEOUT).

    python bench/pipeline.py --side --pp 2 --schedule 1f1b --microbatches 1,4
        one job: rank 0 prints one BENCH line per M
"""
import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import step_time  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
BATCH = 16
INTERLEAVED_V = 2


def stages_per_rank(schedule):
    return INTERLEAVED_V if schedule == "interleaved_1f1b" else 1


def valid_microbatches(pp, schedule, microbatches):
    """The M values run for (P, schedule): interleaved only where M % P == 0."""
    if schedule == "interleaved_1f1b":
        return [m for m in microbatches if m % pp == 0]
    return list(microbatches)


def side(pp, schedule, microbatches, steps, cache_dir):
    import torch

    import raf_dist
    from mpi4py import MPI
    from raf_dist import distributed as dist

    torch.set_num_threads(1)  # torch only captures the model here
    comm = dist.get_communicator()
    if comm.size != pp:
        raise SystemExit(f"run with mpiexec -n {pp} (got {comm.size} ranks)")
    v = stages_per_rank(schedule)
    module, x, y = step_time.make("gpt")
    for m in microbatches:
        rows = BATCH if BATCH % m == 0 else m * math.ceil(BATCH / m)
        if rows != x.shape[0]:
            gen = torch.Generator().manual_seed(1)
            xm = torch.randint(0, 512, (rows, x.shape[1]), generator=gen)
            ym = torch.randint(0, 512, (rows, y.shape[1]), generator=gen)
        else:
            xm, ym = x, y
        config = dist.get_config()
        config.update({"pipeline_parallel_size": pp, "num_microbatches": m,
                       "pipeline_schedule": schedule})
        if v > 1:
            config.pipeline_stages_per_rank = v
        start = time.perf_counter()
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xm,)),
                                   optimizer=raf_dist.optim.Adam(lr=1e-3), cache_dir=cache_dir)
        build_s = comm.mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        xn, yn = xm.numpy(), ym.numpy()
        bubbles = []

        def timer(fn):
            comm.mpi_comm.Barrier()
            began = time.perf_counter()
            fn()
            elapsed = comm.mpi_comm.allreduce(time.perf_counter() - began, op=MPI.MAX)
            timelines = comm.mpi_comm.gather(list(trainer.last_timeline), root=0)
            if comm.rank == 0:
                span = (max(e[4] for t in timelines for e in t)
                        - min(e[3] for t in timelines for e in t))
                idle = [1.0 - sum(e[4] - e[3] for e in t) / span for t in timelines]
                bubbles.append(statistics.mean(idle))
            return elapsed

        ms = harness.median_ms(lambda: trainer.step(xn, yn), steps, warmup=2, timer=timer)
        peaks = comm.mpi_comm.gather(trainer.stats()["pipeline"]["peak_saved_bytes"], root=0)
        if comm.rank == 0:
            per_stage = {}
            for held in peaks:
                for s, b in held.items():
                    per_stage[int(s)] = max(per_stage.get(int(s), 0), int(b))
            harness.report({
                "pp": pp, "schedule": schedule, "v": v, "microbatches": m, "rows": rows,
                "steps": steps, "ms": ms, "build_s": build_s,
                "bubble": statistics.median(bubbles),
                "ideal": (pp - 1) / (m * v + pp - 1),
                "peak_saved_bytes": [per_stage[s] for s in sorted(per_stage)],
                "stage_costs": list(trainer.plan.costs)})


def run_job(argv, timeout):
    """Run one mpiexec job in a process session of its own under a hard timeout; returns
    every BENCH result it printed."""
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(int(timeout)))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=harness.ROOT, start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session started above, nothing else
        out, _ = proc.communicate()
        raise SystemExit(f"{' '.join(argv)} did not finish in {timeout} s:\n{out}")
    results = [json.loads(line[len("BENCH "):]) for line in out.splitlines()
               if line.startswith("BENCH ")]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{out}")
    return results


def ints(text):
    return [int(t) for t in text.split(",") if t]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2,4", help="pipeline sizes P (default: %(default)s)")
    parser.add_argument("--microbatches", default="1,2,4,8",
                        help="microbatch counts M (default: %(default)s)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES),
                        help="schedules to compare (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per M")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="hard limit per mpiexec job in seconds (default: %(default)s)")
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(int(args.pp), args.schedule, ints(args.microbatches), args.steps, args.cache_dir)
        return
    sizes, counts = ints(args.pp), ints(args.microbatches)
    schedules = [s for s in args.schedules.split(",") if s]
    for s in schedules:
        if s not in SCHEDULES:
            parser.error(f"--schedules: unknown schedule {s!r}; expected some of {SCHEDULES}")
    print(f"# {harness.machine()}")
    print(f"# GPT of bench/step_time.py (4 layers, d=128, 4 heads, seq 64, vocab 512, batch "
          f"{BATCH}), Adam, median of {args.steps} steps after 2 warm-up (slowest rank); "
          f"interleaved: v={INTERLEAVED_V} stages per rank")
    cores = len(os.sched_getaffinity(0))
    if any(p > cores for p in sizes):
        print(f"# P > {cores} cores oversubscribes this machine: those bubbles include "
              "time-sharing")
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for pp in sizes:
            for schedule in schedules:
                ms = valid_microbatches(pp, schedule, counts)
                if not ms:
                    print(f"# P={pp} {schedule}: no M in {counts} is a multiple of {pp}; skipped")
                    continue
                argv = [harness.mpiexec(), "-n", str(pp), sys.executable, __file__, "--side",
                        "--pp", str(pp), "--schedule", schedule,
                        "--microbatches", ",".join(map(str, ms)), "--steps", str(args.steps),
                        "--cache-dir", cache]
                began = time.perf_counter()
                got = run_job(argv, args.timeout)
                print(f"# P={pp} {schedule}: M={ms} in {time.perf_counter() - began:.0f} s",
                      flush=True)
                results.extend(got)
    kb = 1024
    print(f"{'P':>2} {'schedule':>16} {'v':>2} {'M':>2} {'step ms':>8} {'bubble':>7} "
          f"{'ideal':>6}  peak activations per stage (KB)")
    for r in results:
        peaks = " ".join(f"{b / kb:.0f}" for b in r["peak_saved_bytes"])
        print(f"{r['pp']:>2} {r['schedule']:>16} {r['v']:>2} {r['microbatches']:>2} "
              f"{r['ms']:8.1f} {r['bubble']:7.1%} {r['ideal']:6.1%}  {peaks}")


if __name__ == "__main__":
    main()
