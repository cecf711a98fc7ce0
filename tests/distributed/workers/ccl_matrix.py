"""Every collective x dtype x reduce op, on sizes that do and do not divide by N (and sizes
smaller than N), checked against numpy; alltoall in equal blocks and alltoallv with uneven
(and empty) blocks, with its bus-byte count. Each rank regenerates every rank's input from its
seed, so the expected result is computed locally. Prints 'ALL OK <checks>' on success."""
import ml_dtypes
import numpy as np

from raf_dist import distributed as dist

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int32, np.int64]
OPS = ["sum", "avg", "max", "min"]
SIZES = [1, 3, 7, 1000, 4097]


def data(rank, size, dtype):
    # Small integers (halved for floats) keep every sum exact in float16/bfloat16, so results
    # can be compared bit for bit whatever the reduction order.
    ints = np.random.default_rng(1000 * rank + size).integers(-8, 9, size)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return ints.astype(dtype)
    return (ints * 0.5).astype(dtype)


def reference(stack, op, dtype, n):
    wide = stack.astype(np.float64)
    if op == "max":
        return stack.max(axis=0)
    if op == "min":
        return stack.min(axis=0)
    total = wide.sum(axis=0)
    if op == "sum":
        return total.astype(dtype)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return np.trunc(total / n).astype(dtype)  # like NCCL's ncclAvg: truncating division
    # sum, then divide once: in float64 for float64, in float32 for the narrower floats
    wide_type = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    return (total.astype(wide_type) / wide_type(n)).astype(dtype)


def main():
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    checks = 0
    for dtype in DTYPES:
        for size in SIZES:
            inputs = np.stack([data(r, size, dtype) for r in range(n)])
            mine = inputs[rank].copy()
            shard = -(-size // n)
            for op in OPS:
                expected = reference(inputs, op, dtype, n)
                got = dist.allreduce(mine, op=op)
                np.testing.assert_array_equal(got, expected, err_msg=f"allreduce {op} {dtype} {size}")
                padded = np.zeros(shard * n, dtype=dtype)
                padded[:size] = expected
                got = dist.reduce_scatter(mine, op=op)
                np.testing.assert_array_equal(got, padded[rank * shard:(rank + 1) * shard],
                                              err_msg=f"reduce_scatter {op} {dtype} {size}")
                checks += 2
            in_place = mine.copy()
            dist.allreduce(in_place, op="sum", out=in_place)
            np.testing.assert_array_equal(in_place, reference(inputs, "sum", dtype, n))
            full = np.zeros(shard * n, dtype=dtype)
            full[:size] = inputs[0]
            gathered = dist.allgather(full[rank * shard:(rank + 1) * shard].copy(), numel=size)
            np.testing.assert_array_equal(gathered, inputs[0], err_msg=f"allgather {dtype} {size}")
            buf = mine.copy()
            dist.broadcast(buf, root=n - 1)
            np.testing.assert_array_equal(buf, inputs[n - 1], err_msg=f"broadcast {dtype} {size}")
            # ring: every rank posts its receive before its send (must not deadlock)
            got = np.empty_like(mine)
            recv = dist.recv(got, src=(rank - 1) % n, async_op=True)
            dist.send(mine, dst=(rank + 1) % n)
            recv.wait()
            np.testing.assert_array_equal(got, inputs[(rank - 1) % n])
            checks += 4
            # alltoall: every rank sends block j of its n * size elements to rank j
            blocks = np.stack([data(r, n * size, dtype) for r in range(n)])
            got = dist.alltoall(blocks[rank])
            expected = np.concatenate([blocks[j][rank * size:(rank + 1) * size]
                                       for j in range(n)])
            np.testing.assert_array_equal(got, expected, err_msg=f"alltoall {dtype} {size}")
            # alltoallv: rank r sends counts[r][j] elements to rank j (some zero)
            counts = [[(r + 2 * j + size) % 5 for j in range(n)] for r in range(n)]
            sent = [data(r, sum(counts[r]), dtype) for r in range(n)]
            got = dist.alltoallv(sent[rank], counts[rank])
            expected = np.concatenate([sent[j][sum(counts[j][:rank]):
                                               sum(counts[j][:rank + 1])] for j in range(n)])
            np.testing.assert_array_equal(got, expected, err_msg=f"alltoallv {dtype} {size}")
            checks += 2
    # bus bytes: an even alltoall counts (N-1)/N of its input, an uneven one what leaves
    dist.reset_comm_counters()
    dist.alltoall(np.ones(4 * n, np.float32))
    dist.alltoallv(np.ones(3 * n, np.float64), [3] * n, [3] * n, async_op=True).wait()
    got = dist.comm_counters()["alltoall"]
    assert got["calls"] == 2, got
    assert got["bus_bytes"] == (n - 1) / n * 16 * n + 3 * (n - 1) * 8, got
    checks += 1
    dist.barrier()
    print(f"rank {rank}: ALL OK {checks}")


if __name__ == "__main__":
    main()
