"""DESIGN.md section 5's guard: after memory planning, no allocation may sit on the storage
of a buffer an asynchronous collective is still reading or writing (between its start and its
wait) and no call may use it or a view into it. Checked on real data-parallel and ZeRO-1/2/3 steps lowered through the CPU pipeline; the analysis itself is
checked on a hand-made planned function where the planner's mistake is present."""
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

import raf_dist
from models import make, raf_optimizer
from raf_dist.compiler.build import lower_and_plan
from raf_dist.compiler.memory import inflight_buffers, inflight_storage_conflicts
from raf_dist.passes import AllReduceGradients, DispatchToBLAS, ShardZeRO
from raf_dist.training import build_train_step


def _planned_step(model_name, bucket_bytes, distribute=None):
    module, x, _ = make(model_name, 4)
    mod, _ = build_train_step(raf_dist.frontend.from_pytorch(module, (x,)), "cross_entropy",
                              raf_optimizer("adamw"))
    distribute = distribute or AllReduceGradients(2, bucket_bytes, overlap=True)
    mod = DispatchToBLAS()(distribute(mod))
    # planned, gradients in buckets
    return lower_and_plan(mod, tvm.target.Target("llvm"))["train_step"]


@pytest.mark.parametrize("model_name, bucket_bytes", [("mlp", 1000), ("cnn", 500),
                                                      ("transformer", 4000)])
def test_no_allocation_on_an_in_flight_bucket(model_name, bucket_bytes):
    func = _planned_step(model_name, bucket_bytes)
    assert inflight_buffers(func) >= 2  # the check below is not vacuous
    assert inflight_storage_conflicts(func) == []


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("model_name, bucket_bytes, world_size", [
    ("mlp", 1000, 2), ("cnn", 500, 3), ("transformer", 4000, 4)])
def test_no_allocation_on_in_flight_zero_buffers(level, model_name, bucket_bytes, world_size):
    func = _planned_step(model_name, bucket_bytes,
                         ShardZeRO(level, world_size, bucket_bytes, overlap=True))
    assert inflight_buffers(func) >= 4  # reduce_scatters and allgathers were checked
    assert inflight_storage_conflicts(func) == []


def test_the_check_finds_a_planner_reusing_in_flight_storage():
    @I.ir_module
    class Unsafe:  # what the unsafe IR form leads to: a temporary placed on the bucket
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32")):
            storage = R.memory.alloc_storage(R.shape([16]), 0, R.str("global"), R.dtype("float32"))
            bucket = R.memory.alloc_tensor(storage, 0, R.shape([4]), R.dtype("float32"), 0)
            handle = R.call_packed("raf_dist.ccl.allreduce_start", bucket, R.str("avg"), 0, bucket,
                                   ty_args=R.Prim("int64"))
            temp = R.memory.alloc_tensor(storage, 0, R.shape([4]), R.dtype("float32"), 0)
            _ = R.call_packed("raf_dist.ccl.wait", handle, bucket, ty_args=R.Tuple())
            after = R.memory.alloc_tensor(storage, 0, R.shape([4]), R.dtype("float32"), 0)
            return after

    assert inflight_storage_conflicts(Unsafe["main"]) == [("handle", "temp")]


def test_the_check_reads_arena_views_by_their_bytes():
    """In one arena (compiler/share_storage.py) a view on bytes a collective is still
    reducing is a conflict; a view on other bytes of the same arena is not."""
    @I.ir_module
    class Arena:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32")):
            storage = R.memory.alloc_storage(R.shape([256]), 0, R.str("global"), R.dtype("uint8"))
            arena = R.memory.alloc_tensor(storage, 0, R.shape([256]), R.dtype("uint8"), 0)
            sent = R.call_packed("raf_dist.arena.view", arena, 64, R.shape([16]), R.str("float32"),
                                 ty_args=R.Tensor((16,), "float32"))
            handle = R.call_packed("raf_dist.ccl.allreduce_start", sent, R.str("avg"), 0, sent,
                                   ty_args=R.Prim("int64"))
            beside = R.call_packed("raf_dist.arena.view", arena, 128, R.shape([32]),
                                   R.str("float32"), ty_args=R.Tensor((32,), "float32"))
            inside = R.call_packed("raf_dist.arena.view", arena, 96, R.shape([8]),
                                   R.str("bfloat16"), ty_args=R.Tensor((8,), "bfloat16"))
            _ = R.call_packed("raf_dist.ccl.wait", handle, sent, ty_args=R.Tuple())
            after = R.call_packed("raf_dist.arena.view", arena, 64, R.shape([16]),
                                  R.str("float32"), ty_args=R.Tensor((16,), "float32"))
            return after

    assert inflight_storage_conflicts(Arena["main"]) == [("handle", "inside")]
