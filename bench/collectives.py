"""Bus bandwidth of raf_dist's collectives against raw mpi4py on the same buffers, same run.

    mpirun -np 2 python bench/collectives.py [--max-mb 64] [--iters 20]

raf_dist is called the way compiled code calls it (the native ``raf_dist.ccl.*`` function on
pre-wrapped tensors), so the figure includes its validation, the hand-off to the
communication thread and the wait. The two are timed alternately, each measurement between
barriers, and the median is reported. Bus bytes follow nccl-tests: allreduce 2(N-1)/N*S,
reduce_scatter and allgather (N-1)/N*S, S = the full buffer.
"""
import argparse
import statistics
import time

import numpy as np
import tvm_ffi
from mpi4py import MPI

from raf_dist import _native
from raf_dist import distributed as dist


def make_cases(comm, count):
    n = comm.size
    shard = count // n
    full = np.ones(count, np.float32)
    out_full = np.empty(count, np.float32)
    part = np.ones(shard, np.float32)
    out_part = np.empty(shard, np.float32)
    t = tvm_ffi.from_dlpack
    g = dist.get_communicator().group
    mpi = comm
    return {
        "allreduce": (
            2 * (n - 1) / n * count * 4,
            lambda f=_native.func("allreduce"), a=(t(full), "sum", g, t(out_full)): f(*a),
            lambda: mpi.Allreduce(full, out_full, op=MPI.SUM),
        ),
        "reduce_scatter": (
            (n - 1) / n * count * 4,
            lambda f=_native.func("reduce_scatter"), a=(t(full), "sum", g, t(out_part)): f(*a),
            lambda: mpi.Reduce_scatter_block(full, out_part, op=MPI.SUM),
        ),
        "allgather": (
            (n - 1) / n * count * 4,
            lambda f=_native.func("allgather"), a=(t(part), g, t(out_full)): f(*a),
            lambda: mpi.Allgather(part, out_full),
        ),
    }


def timed(comm, fn):
    comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)  # the slowest rank defines the collective


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    dist.get_communicator()
    sizes = []
    nbytes = 4096
    while nbytes <= args.max_mb * 2**20:
        sizes.append(nbytes)
        nbytes *= 4
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        for kind, (bus_bytes, raf, raw) in make_cases(comm, count).items():
            iters = max(5, min(args.iters * 10, int(args.iters * 2**22 / nbytes)))
            raf(), raw()  # warm up both paths
            raf_times, raw_times = [], []
            for _ in range(iters):
                raf_times.append(timed(comm, raf))
                raw_times.append(timed(comm, raw))
            raf_bw = bus_bytes / statistics.median(raf_times) / 1e9
            raw_bw = bus_bytes / statistics.median(raw_times) / 1e9
            rows.append((kind, nbytes, raf_bw, raw_bw))
    if comm.rank == 0:
        print(f"# {comm.size} ranks, float32, median of alternating runs; GB/s = bus bytes / s")
        print(f"{'collective':15s} {'size':>9s} {'raf_dist GB/s':>14s} {'mpi4py GB/s':>12s} {'ratio':>6s}")
        for kind, nbytes, raf_bw, raw_bw in sorted(rows, key=lambda r: (r[0], r[1])):
            size = f"{nbytes // 1024} KB" if nbytes < 2**20 else f"{nbytes // 2**20} MB"
            print(f"{kind:15s} {size:>9s} {raf_bw:14.3f} {raw_bw:12.3f} {raf_bw / raw_bw:6.2f}")
        big = [r[2] / r[3] for r in rows if r[1] >= 2**20]
        print(f"# geometric-mean ratio from 1 MB up: {statistics.geometric_mean(big):.3f} "
              f"(min {min(big):.3f}); goal >= 0.9")


if __name__ == "__main__":
    main()
