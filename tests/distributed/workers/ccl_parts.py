"""A bucket's reduce-scatter and allgather over several tensors (the ZeRO passes' form,
``raf_dist.ccl.reduce_scatter(t_1, ..., t_k, op, group, shards)`` and
``raf_dist.ccl.allgather(shards, group, t_1, ..., t_k)``): tensors whose sizes the ranks do
not divide (padded shards), one smaller than the ranks, a large one among small ones. Every
value is an integer, exact in float64: results are compared exactly. Prints 'ALL OK'."""
import numpy as np
import tvm
import tvm_ffi

from raf_dist import distributed as dist

# 1: fewer elements than ranks; 5, 7, 64 (at 3 ranks), 1_200_001 (9.6 MB of float64, among
# small ones), 1000: not divisible by 3; 3: divisible
SIZES = (5, 1, 7, 64, 1_200_001, 1000, 3)


def main():
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    full = [(rank + 1) * np.arange(s, dtype=np.float64) + i for i, s in enumerate(SIZES)]
    reduced = [sum(r + 1 for r in range(n)) * np.arange(s, dtype=np.float64) + n * i
               for i, s in enumerate(SIZES)]
    shards = [-(-s // n) for s in SIZES]
    mine = [r[rank * c:(rank + 1) * c] for r, c in zip(reduced, shards)]
    expected = np.concatenate([np.pad(m, (0, c - len(m))) for m, c in zip(mine, shards)])
    out = tvm.runtime.tensor(np.full(sum(shards), -1.0))
    reduce_scatter = tvm_ffi.get_global_func("raf_dist.ccl.reduce_scatter")
    reduce_scatter(*[tvm.runtime.tensor(t) for t in full], "sum", 0, out)
    np.testing.assert_array_equal(out.numpy(), expected)
    # the shards back into full tensors: every rank gets the reduced tensors whole
    back = [tvm.runtime.tensor(np.full(s, -1.0)) for s in SIZES]
    tvm_ffi.get_global_func("raf_dist.ccl.allgather")(out, 0, *back)
    for got, want in zip(back, reduced):
        np.testing.assert_array_equal(got.numpy(), want)
    print(f"rank {rank}: ALL OK")


if __name__ == "__main__":
    main()
