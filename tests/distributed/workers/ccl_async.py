"""Asynchronous collectives: several in flight at once with compute in between, waited on in
any order; inputs whose Python references are gone stay alive until the wait; large ring
exchanges; bus-byte counters match nccl-tests' formulas. Prints 'ALL OK'."""
import gc

import numpy as np
import tvm_ffi

from raf_dist import _native
from raf_dist import distributed as dist

ELEMS = 1 << 20  # 4 MB of float32 per buffer


def main():
    comm = dist.get_communicator()
    n, rank = comm.size, comm.rank
    dist.reset_comm_counters()

    bufs = [np.full(ELEMS, rank + i, np.float32) for i in range(4)]
    handles = [dist.allreduce(b, op="sum", out=b, async_op=True) for b in bufs]
    a = np.random.default_rng(rank).standard_normal((256, 256))
    for _ in range(20):  # compute while the collectives run on the communication thread
        a = np.tanh(a @ a.T / 256)
    for i in reversed(range(4)):  # waiting out of order is fine
        handles[i].wait()
        np.testing.assert_array_equal(bufs[i], np.full(ELEMS, sum(r + i for r in range(n)), np.float32))

    # The native side holds the input: drop every Python reference before waiting.
    out = np.empty(ELEMS, np.float32)
    handle = _native.func("allreduce_start")(
        tvm_ffi.from_dlpack(np.full(ELEMS, 2.0, np.float32)), "avg", comm.group,
        tvm_ffi.from_dlpack(out))
    gc.collect()
    junk = [np.full(ELEMS, -1.0, np.float32) for _ in range(4)]  # would reuse freed memory
    _native.func("wait")(handle, tvm_ffi.from_dlpack(out))
    np.testing.assert_array_equal(out, 2.0)
    del junk

    # A large ring exchange in both directions at once.
    left, right = (rank - 1) % n, (rank + 1) % n
    from_left, from_right = np.empty(ELEMS, np.float32), np.empty(ELEMS, np.float32)
    hs = [dist.recv(from_left, src=left, async_op=True), dist.recv(from_right, src=right, async_op=True),
          dist.send(np.full(ELEMS, rank, np.float32), dst=right, async_op=True),
          dist.send(np.full(ELEMS, rank, np.float32), dst=left, async_op=True)]
    for h in hs:
        h.wait()
    assert from_left[0] == left and from_right[-1] == right

    assert _native.func("num_pending")() == 0

    # A handle dropped without a wait: the runtime lets go of it (and of its buffers once the
    # collective completes) instead of holding it until exit. Every rank drops its handle.
    dropped = np.ones(ELEMS, np.float32)
    dist.allreduce(dropped, out=dropped, async_op=True)
    assert _native.func("num_pending")() == 0  # the Handle was garbage at once
    dist.barrier()  # collectives run in order: the dropped one is complete by now
    np.testing.assert_array_equal(dropped, n)
    counters = dist.comm_counters()
    nbytes = ELEMS * 4
    expected_allreduce = 6 * 2 * (n - 1) / n * nbytes
    assert counters["allreduce"]["calls"] == 6, counters
    assert abs(counters["allreduce"]["bus_bytes"] - expected_allreduce) < 1e-6, counters
    assert counters["send"]["bus_bytes"] == 2 * nbytes and counters["recv"]["calls"] == 2

    dist.reset_comm_counters()
    shard = dist.reduce_scatter(np.ones(1001, np.float64))
    dist.allgather(shard, numel=1001)
    counters = dist.comm_counters()
    assert abs(counters["reduce_scatter"]["bus_bytes"] - (n - 1) / n * 1001 * 8) < 1e-6
    assert abs(counters["allgather"]["bus_bytes"] - (n - 1) / n * 1001 * 8) < 1e-6
    print(f"rank {rank}: ALL OK")


if __name__ == "__main__":
    main()
