"""Where an N-rank data-parallel step's time goes when the ranks share fewer cores (#33).

    python bench/oversubscription.py [--ranks 2,4,8] [--steps 30]

bench/plan_validation.py predicts its 4- and 8-rank meshes on this 2-core machine 11-37% too
fast. This takes the dp N step of that script's GPT (bench/step_time.py, global batch 16) apart
with N ranks that each train their own copy (``Trainer(local=True)``, the dp step's per-rank
batch 16 / N, no communication inside the step), in one ``mpiexec -n N`` job per N, every
rank stepping the same number of times:

- ``alone``: the local step only; with N ranks on C cores each rank gets C / N of a core, so
  this is the step's compute under sharing (processor sharing predicts N / C times the
  one-process step on one core, printed beside it);
- ``+grad``: the local step then a raf_dist allreduce of the step's gradient bytes (what the
  dp step's one bucket reduces), as the dp step does;
- ``+grad+4B``: the same followed by a 4-byte allreduce (every rank leaves it together);
- ``gemm+grad``: the local step replaced by float32 GEMMs of about its length, then the same
  gradient allreduce;
- ``grad``: the gradient allreduce alone, between barriers (what ``proxies calibrate``'s
  alpha-beta describes).

Prints per N the slowest rank's milliseconds per iteration of each, and the excess of
``+grad`` over ``alone`` + ``grad``: the part of a step that neither its compute under sharing
nor its collective between barriers accounts for.

``--arrivals`` instead runs the dp N step itself (the Trainer under data parallelism, as
bench/plan_validation.py's dp mesh) and prints, for every collective of a step in order (the
Trainer's rows allgather, then the VM's ``raf_dist.ccl.*`` calls: a VM instrument that records
only those), when the ranks enter and leave it: the earliest, median and latest rank, in ms
from the step's first start, medians over the measured steps. Each rank's wall clock
(``time.time``) is the common time base: one host.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

GLOBAL_BATCH = 16


def side(steps, batch=None):
    import numpy as np
    from mpi4py import MPI

    import raf_dist
    from raf_dist.distributed import collectives, get_communicator
    from raf_dist.runtime.threads import set_num_threads, threads_per_rank
    from step_time import make

    comm = MPI.COMM_WORLD
    set_num_threads(threads_per_rank(get_communicator().local_size))
    batch = batch or GLOBAL_BATCH // comm.size
    module, x, y = make("gpt")
    numel = sum(p.numel() for p in module.parameters())
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[:batch],)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), local=True)
    xs, ys = x[:batch].numpy(), y[:batch].numpy()
    grad, flag = np.ones(numel, np.float32), np.ones(1, np.float32)
    for _ in range(3):
        trainer.step(xs, ys)

    def per_iteration(body, count=steps):
        comm.Barrier()
        began = time.perf_counter()
        for _ in range(count):
            body()
        return comm.allreduce((time.perf_counter() - began) / count, op=MPI.MAX)

    def step():
        trainer.step(xs, ys)

    def step_grad():
        step()
        collectives.allreduce(grad, "sum", grad)

    def step_grad_flag():
        step_grad()
        collectives.allreduce(flag, "sum", flag)

    alone = per_iteration(step)
    # GEMMs of about the step's compute (the slowest rank's, under the same sharing)
    a = np.random.default_rng(0).standard_normal((256, 256), np.float32)
    began = time.perf_counter()
    for _ in range(20):
        a @ a
    per_gemm = comm.allreduce((time.perf_counter() - began) / 20, op=MPI.MAX)
    gemms = max(1, int(alone / per_gemm))

    def gemm_grad():
        for _ in range(gemms):
            a @ a
        collectives.allreduce(grad, "sum", grad)

    def grad_alone(count=10):
        # each allreduce timed from the barrier's end (the barrier itself left out)
        total = 0.0
        for _ in range(count):
            comm.Barrier()
            began = time.perf_counter()
            collectives.allreduce(grad, "sum", grad)
            total += time.perf_counter() - began
        return comm.allreduce(total / count, op=MPI.MAX)

    row = {"ranks": comm.size, "batch": batch, "grad_bytes": grad.nbytes, "alone": alone,
           "+grad": per_iteration(step_grad), "+grad+4B": per_iteration(step_grad_flag),
           "gemm+grad": per_iteration(gemm_grad), "grad": grad_alone()}
    if comm.rank == 0:
        harness.report({k: v * 1e3 if isinstance(v, float) else v for k, v in row.items()})


def arrivals(steps):
    """The ``--arrivals`` side (module docstring)."""
    import statistics

    import raf_dist
    from raf_dist import distributed as dist
    from step_time import make

    comm = dist.get_communicator()
    dp = comm.size
    dist.get_config().update({"enable_data_parallel": dp > 1})
    module, x, y = make("gpt")
    rows = slice(comm.rank * GLOBAL_BATCH // dp, (comm.rank + 1) * GLOBAL_BATCH // dp)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3))
    xs, ys = x[rows].numpy(), y[rows].numpy()
    for _ in range(3):
        trainer.step(xs, ys)
    marks = []  # (what, "in" / "out", wall time)

    def instrument(func, symbol, before_run, ret_value, *args):
        if str(symbol).startswith("raf_dist.ccl."):
            marks.append((str(symbol).rsplit(".", 1)[-1], "in" if before_run else "out",
                          time.time()))
        return 0

    executor = trainer.executor
    for vm in executor._vms:
        vm.set_instrument(instrument)
    rows_per_rank = executor._rows_per_rank

    def timed_rows(*args, **kwargs):
        marks.append(("rows allgather", "in", time.time()))
        try:
            return rows_per_rank(*args, **kwargs)
        finally:
            marks.append(("rows allgather", "out", time.time()))

    executor._rows_per_rank = timed_rows
    per_step = []
    for _ in range(steps):
        del marks[:]
        marks.append(("step", "in", time.time()))
        trainer.step(xs, ys)
        marks.append(("step", "out", time.time()))
        per_step.append(list(marks))
    gathered = comm.mpi_comm.gather(per_step)
    if comm.rank == 0:
        table = {}
        for s in range(steps):
            ranks = [g[s] for g in gathered]
            base = min(r[0][2] for r in ranks)
            for i, (what, side_, _) in enumerate(ranks[0]):
                times = sorted((r[i][2] - base) * 1e3 for r in ranks)
                table.setdefault((i, what, side_), []).append(
                    (times[0], statistics.median(times), times[-1]))
        harness.report({"ranks": dp, "rows": [
            [what, side_] + [statistics.median(t[j] for t in v) for j in range(3)]
            for (i, what, side_), v in sorted(table.items())]})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", action="store_true")
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, help="per-rank batch (default: 16 / ranks)")
    p.add_argument("--arrivals", action="store_true",
                   help="the dp N step's collectives: when the ranks enter and leave them")
    a = p.parse_args()
    if a.side:
        if a.arrivals:
            arrivals(a.steps)
        else:
            side(a.steps, a.batch)
        return
    if a.arrivals:
        for n in (int(r) for r in a.ranks.split(",")):
            got = harness.run_side([harness.mpiexec(), "-n", str(n), sys.executable, __file__,
                                    "--side", "--arrivals", "--steps", str(a.steps)],
                                   timeout=900)
            print(f"# dp {n}: ms from the step's first start (medians over {a.steps} steps): "
                  "earliest / median / latest rank")
            for what, side_, first, median, last in got["rows"]:
                print(f"{n:>3} {what:>20} {side_:>3} {first:8.1f} {median:8.1f} {last:8.1f}")
        return
    print(f"# {harness.machine()}; bench/step_time.py's GPT, global batch {GLOBAL_BATCH}, "
          "each rank its own copy; ms per iteration, slowest rank")
    cores = len(os.sched_getaffinity(0))
    print(f"{'ranks':>5} {'batch':>5} {'alone':>7} {'N/C x 1-core':>12} {'+grad':>7} "
          f"{'+grad+4B':>9} {'gemm+grad':>10} {'grad':>6} {'excess':>7}")
    for n in (int(r) for r in a.ranks.split(",")):
        # the one-process step on one core at this N's per-rank batch
        one = harness.run_side([harness.mpiexec(), "-n", "1", sys.executable, __file__, "--side",
                                "--steps", str(a.steps), "--batch", str(GLOBAL_BATCH // n)],
                               cpu_set=harness.cores(1), timeout=600)["alone"]
        got = harness.run_side([harness.mpiexec(), "-n", str(n), sys.executable, __file__,
                                "--side", "--steps", str(a.steps)], timeout=900)
        shared = one * max(1.0, n / cores)
        excess = got["+grad"] - got["alone"] - got["grad"]
        print(f"{n:>5} {got['batch']:>5} {got['alone']:>7.1f} {shared:>12.1f} {got['+grad']:>7.1f} "
              f"{got['+grad+4B']:>9.1f} {got['gemm+grad']:>10.1f} {got['grad']:>6.1f} "
              f"{excess:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
