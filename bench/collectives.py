"""Bus bandwidth of raf_dist's collectives against raw mpi4py on the same buffers, each alone.

    python bench/collectives.py [--np 2] [--max-mb 64] [--iters 20] [--rounds 3]

raf_dist is called the way compiled code calls it (the native ``raf_dist.ccl.*`` function on
pre-wrapped tensors), so the figure includes its validation, the hand-off to the
communication thread and the wait; mpi4py calls MPI directly, in a job that never imports
raf_dist. Each side is its own `mpiexec -n N` job (bench/harness.py), the sides alternating for
``--rounds`` rounds; within a job each measurement sits between barriers (slowest rank) and the
median is kept. Bus bytes follow nccl-tests: allreduce 2(N-1)/N*S, reduce_scatter,
allgather and alltoall (N-1)/N*S, S = the full buffer. ``alltoallv`` is the same exchange
given per-rank counts and offsets (MPI_Alltoallv on both sides).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

KINDS = ("allreduce", "reduce_scatter", "allgather", "alltoall", "alltoallv")


def bus_bytes(kind, n, count):
    return (2 if kind == "allreduce" else 1) * (n - 1) / n * count * 4


def make_calls(side, comm, count):
    """{kind: a no-argument call running that collective once on ``count`` float32 elements}."""
    n = comm.size
    full, out_full = np.ones(count, np.float32), np.empty(count, np.float32)
    part, out_part = np.ones(count // n, np.float32), np.empty(count // n, np.float32)
    splits = np.full(n, count // n, np.int64)  # alltoall: N equal blocks of the buffer
    displs = np.arange(n, dtype=np.int64) * (count // n)
    blocks, out_blocks = full[:count // n * n], out_full[:count // n * n]
    if side == "mpi4py":
        spec = [splits.astype(np.int32), displs.astype(np.int32)]
        return {"allreduce": lambda: comm.Allreduce(full, out_full, op=MPI.SUM),
                "reduce_scatter": lambda: comm.Reduce_scatter_block(full, out_part, op=MPI.SUM),
                "allgather": lambda: comm.Allgather(part, out_full),
                "alltoall": lambda: comm.Alltoall(blocks, out_blocks),
                "alltoallv": lambda: comm.Alltoallv([blocks, *spec, MPI.FLOAT],
                                                    [out_blocks, *spec, MPI.FLOAT])}
    import tvm_ffi

    from raf_dist import _native
    from raf_dist import distributed as dist
    t, g = tvm_ffi.from_dlpack, dist.get_communicator().group
    calls = {"allreduce": (_native.func("allreduce"), (t(full), "sum", g, t(out_full))),
             "reduce_scatter": (_native.func("reduce_scatter"), (t(full), "sum", g, t(out_part))),
             "allgather": (_native.func("allgather"), (t(part), g, t(out_full))),
             "alltoall": (_native.func("alltoall"), (t(blocks), g, t(out_blocks))),
             "alltoallv": (_native.func("alltoall"), (t(blocks), t(splits), t(splits), g,
                                                      t(out_blocks)))}
    return {kind: (lambda f=f, a=a: f(*a)) for kind, (f, a) in calls.items()}


def timed(comm, fn):
    comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)  # the slowest rank defines the collective


def run_side(side, sizes, iters_base):
    comm = MPI.COMM_WORLD
    result = {}
    for nbytes in sizes:
        count = nbytes // 4
        for kind, call in make_calls(side, comm, count).items():
            iters = max(5, min(iters_base * 10, int(iters_base * 2**22 / nbytes)))
            call()  # warm up
            seconds = statistics.median(timed(comm, call) for _ in range(iters))
            result[f"{kind}:{nbytes}"] = bus_bytes(kind, comm.size, count) / seconds / 1e9
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", choices=["raf", "mpi4py"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = []
    nbytes = 4096
    while nbytes <= args.max_mb * 2**20:
        sizes.append(nbytes)
        nbytes *= 4
    if args.side:
        result = run_side(args.side, sizes, args.iters)
        if MPI.COMM_WORLD.rank == 0:
            harness.report(result)
        return
    common = [harness.mpiexec(), "-n", str(args.np), sys.executable, __file__, "--max-mb",
              str(args.max_mb), "--iters", str(args.iters)]
    results = harness.alternate({"raf": common + ["--side", "raf"],
                                 "mpi4py": common + ["--side", "mpi4py"]}, args.rounds,
                                log=lambda line: None)
    print(f"# {args.np} ranks, float32; {harness.machine()}; each side alone, {args.rounds} "
          "alternating rounds; GB/s = bus bytes / s (median over rounds); ratio = median "
          "[spread] of the per-round ratios")
    print(f"{'collective':15s} {'size':>9s} {'raf_dist GB/s':>14s} {'mpi4py GB/s':>12s} "
          f"{'ratio [spread]':>16s}")
    big = []
    for kind in KINDS:
        for nbytes in sizes:
            key = f"{kind}:{nbytes}"
            raf = [r[key] for r in results["raf"]]
            raw = [r[key] for r in results["mpi4py"]]
            size = f"{nbytes // 1024} KB" if nbytes < 2**20 else f"{nbytes // 2**20} MB"
            # bandwidth: higher is better, so the ratio is raf / mpi4py (>= 1: raf_dist as fast)
            print(f"{kind:15s} {size:>9s} {statistics.median(raf):14.3f} "
                  f"{statistics.median(raw):12.3f} {harness.format_ratio(raf, raw):>16s}")
            if nbytes >= 2**20:
                big.append(harness.ratio_summary(raf, raw)[0])
    print(f"# geometric mean of the median ratios from 1 MB up: "
          f"{statistics.geometric_mean(big):.3f} (min {min(big):.3f}); goal >= 0.9")


if __name__ == "__main__":
    main()
