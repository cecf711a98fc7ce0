"""Started without a launcher, the job is a world of one: the communicator and every
collective work (collectives are identities / whole-tensor shards), and bad input raises
clear errors before anything is sent."""
import numpy as np
import pytest
import tvm_ffi

from raf_dist import _native

from raf_dist import distributed as dist


def test_communicator_fields():
    comm = dist.get_communicator()
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
    assert isinstance(comm.host, str) and comm.host
    assert dist.get_communicator() is comm


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
def test_allreduce_identity(op):
    x = np.arange(7, dtype=np.float32)
    np.testing.assert_array_equal(dist.allreduce(x, op=op), x)


def test_shards_are_whole_tensor():
    x = np.arange(5, dtype=np.int64)
    np.testing.assert_array_equal(dist.reduce_scatter(x), x)
    np.testing.assert_array_equal(dist.allgather(x), x)


def test_counters_count_calls_and_zero_bus_bytes():
    dist.reset_comm_counters()
    dist.allreduce(np.ones(4, np.float32))
    counters = dist.comm_counters()
    assert counters["allreduce"] == {"calls": 1, "bus_bytes": 0.0}  # (N-1)/N = 0
    assert set(counters) == {"allreduce", "reduce_scatter", "allgather", "broadcast",
                             "send", "recv", "barrier", "alltoall"}


def test_alltoall_in_a_world_of_one_and_its_errors():
    """The exchange is a copy to itself; bad counts name the problem before any message."""
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(dist.alltoall(x), x)
    np.testing.assert_array_equal(dist.alltoallv(x, [6]), x)
    native = _native.func("alltoall")
    t = tvm_ffi.from_dlpack
    with pytest.raises(ValueError, match="cannot run in place"):
        native(t(x), 0, t(x))
    with pytest.raises(ValueError, match="send splits sum to 5 elements but the input holds 6"):
        native(t(x), t(np.array([5], np.int64)), t(np.array([6], np.int64)), 0,
               t(np.empty(6, np.float32)))
    with pytest.raises(ValueError, match="2 receive splits for a group of 1 ranks"):
        native(t(x), t(np.array([6], np.int64)), t(np.array([3, 3], np.int64)), 0,
               t(np.empty(6, np.float32)))
    with pytest.raises(TypeError, match="int64 tensor in host memory"):
        native(t(x), t(np.array([6], np.int32)), t(np.array([6], np.int64)), 0,
               t(np.empty(6, np.float32)))
    with pytest.raises(ValueError, match="send_counts"):
        dist.alltoallv(x, [-1])


def test_errors_name_the_problem():
    x = np.ones(8, np.float32)
    native_allreduce = _native.func("allreduce")
    with pytest.raises(ValueError, match="input has 8 elements but output has 4"):
        native_allreduce(tvm_ffi.from_dlpack(x), "sum", 0, tvm_ffi.from_dlpack(np.ones(4, np.float32)))
    with pytest.raises(TypeError, match="input is float32 but output is float64"):
        native_allreduce(tvm_ffi.from_dlpack(x), "sum", 0, tvm_ffi.from_dlpack(np.ones(8)))
    with pytest.raises(ValueError, match="unknown process group 7"):
        native_allreduce(tvm_ffi.from_dlpack(x), "sum", 7, tvm_ffi.from_dlpack(x))
    with pytest.raises(ValueError, match="unknown reduce op 'prod'"):
        dist.allreduce(x, op="prod")
    with pytest.raises(TypeError, match="collectives do not support"):
        dist.allreduce(np.ones(3, np.uint8))
    with pytest.raises(ValueError, match="not C-contiguous"):
        dist.allreduce(np.ones((4, 4), np.float32)[:, 1])
    with pytest.raises(ValueError, match="cannot exchange a message with itself"):
        dist.send(x, dst=0)
    with pytest.raises(ValueError, match="outside the group"):
        dist.broadcast(x, root=3)
    with pytest.raises(ValueError, match="out must be"):
        dist.allreduce(x, out=np.ones(8, np.float64))


def test_async_handle_wait_twice_returns_result():
    x = np.ones(16, np.float64)
    handle = dist.allreduce(x, async_op=True)
    np.testing.assert_array_equal(handle.wait(), x)
    np.testing.assert_array_equal(handle.wait(), x)
