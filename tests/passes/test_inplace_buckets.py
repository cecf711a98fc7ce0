"""IR tier for WriteGradientsIntoBuckets (between CallTIRRewrite and memory planning): every
gradient a kernel computes is allocated as a view into its bucket, so nothing is copied
between the kernel and the allreduce and the planner never allocates it; what cannot be traced
is copied in where the pack was. No MPI."""
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import raf_dist
from models import make, raf_optimizer
from raf_dist.compiler.build import lower_and_plan
from raf_dist.compiler.inplace_buckets import WriteGradientsIntoBuckets, packed_call
from raf_dist.compiler.memory import inflight_buffers, inflight_storage_conflicts
from raf_dist.passes import AllReduceGradients, DispatchToBLAS
from raf_dist.training import build_train_step


def _symbols(func):
    return [packed_call(b.value)[0] for block in func.body.blocks for b in block.bindings]


@pytest.mark.parametrize("model_name, bucket_bytes, overlap", [
    ("mlp", 1000, True), ("cnn", 500, False), ("transformer", 4000, True)])
def test_every_gradient_is_computed_in_its_bucket(model_name, bucket_bytes, overlap):
    module, x, _ = make(model_name, 4)
    mod, _ = build_train_step(raf_dist.frontend.from_pytorch(module, (x,)), "cross_entropy",
                              raf_optimizer("adamw"))
    buckets = raf_dist.passes.gradient_buckets(mod, bucket_bytes)
    mod = DispatchToBLAS()(AllReduceGradients(2, bucket_bytes, overlap=overlap)(mod))
    func = lower_and_plan(mod, tvm.target.Target("llvm"))["train_step"]
    symbols = _symbols(func)
    num_params = sum(len(b) for b in buckets)
    assert len(buckets) >= 2
    assert "raf_dist.bucket.pack" not in symbols and "raf_dist.bucket.copy_into" not in symbols
    # one view per gradient where its kernel writes it, one where the optimizer reads it
    assert symbols.count("raf_dist.bucket.view") == 2 * num_params
    assert symbols.count("raf_dist.bucket.empty") == len(buckets)
    if overlap:
        assert inflight_buffers(func) == len(buckets)
    assert inflight_storage_conflicts(func) == []


@I.ir_module
class Lowered:  # what CallTIRRewrite leaves: gradients a (via a reshape) and p
    @R.function(pure=False)
    def main(x: R.Tensor((4,), "float32"), p: R.Tensor((3,), "float32")):
        a = R.builtin.alloc_tensor(R.shape([2, 2]), R.dtype("float32"), R.prim_value(0))
        _k = R.call_packed("kernel", x, a, ty_args=R.Tuple())
        g = R.reshape(a, R.shape([4]))
        bucket = R.call_packed("raf_dist.bucket.pack", g, p, R.shape([0, 16]), R.prim_value(19),
                               ty_args=R.Tensor((19,), "float32"))
        _r = R.call_packed("raf_dist.ccl.allreduce", bucket, R.str("avg"), 0, bucket,
                           ty_args=R.Tuple())
        return bucket


def test_traced_gradient_becomes_a_view_and_a_parameter_is_copied():
    @I.ir_module
    class Expected:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32"), p: R.Tensor((3,), "float32")):
            storage = R.call_packed("raf_dist.bucket.empty", x, R.prim_value(19), R.str("float32"),
                                    ty_args=R.Tensor((19,), "float32"))  # on x's device
            a = R.call_packed("raf_dist.bucket.view", storage, R.prim_value(0), R.shape([2, 2]),
                              R.prim_value(12), ty_args=R.Tensor((2, 2), "float32"))
            _k = R.call_packed("kernel", x, a, ty_args=R.Tuple())
            g = R.reshape(a, R.shape([4]))
            _c = R.call_packed("raf_dist.bucket.copy_into", p, storage, R.prim_value(16),
                               R.prim_value(0), ty_args=R.Tuple())
            bucket = storage
            _r = R.call_packed("raf_dist.ccl.allreduce", bucket, R.str("avg"), 0, bucket,
                               ty_args=R.Tuple())
            return bucket

    tvm.ir.assert_structural_equal(WriteGradientsIntoBuckets()(Lowered), Expected)


def test_gradient_read_after_the_pack_keeps_its_own_memory():
    @I.ir_module
    class ReadAfter:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32")):
            a = R.builtin.alloc_tensor(R.shape([4]), R.dtype("float32"), R.prim_value(0))
            _k = R.call_packed("kernel", x, a, ty_args=R.Tuple())
            bucket = R.call_packed("raf_dist.bucket.pack", a, R.shape([0]), R.prim_value(4),
                                   ty_args=R.Tensor((4,), "float32"))
            _r = R.call_packed("raf_dist.ccl.allreduce", bucket, R.str("avg"), 0, bucket,
                               ty_args=R.Tuple())
            _u = R.call_packed("use", a, ty_args=R.Tuple())  # wants the unreduced value
            return bucket

    func = WriteGradientsIntoBuckets()(ReadAfter)["main"]
    symbols = _symbols(func)
    assert "raf_dist.bucket.view" not in symbols  # a keeps its own allocation
    assert symbols.count("raf_dist.bucket.copy_into") == 1


def test_the_check_finds_a_view_of_an_in_flight_bucket_in_use():
    @I.ir_module
    class Unsafe:  # a kernel writes a gradient into the bucket while the allreduce runs
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32")):
            bucket = R.builtin.alloc_tensor(R.shape([4]), R.dtype("float32"), R.prim_value(0))
            g = R.call_packed("raf_dist.bucket.view", bucket, R.prim_value(0), R.shape([4]),
                              R.prim_value(0), ty_args=R.Tensor((4,), "float32"))
            handle = R.call_packed("raf_dist.ccl.allreduce_start", bucket, R.str("avg"), 0, bucket,
                                   ty_args=R.Prim("int64"))
            late = R.call_packed("kernel", x, g, ty_args=R.Tuple())
            _w = R.call_packed("raf_dist.ccl.wait", handle, bucket, ty_args=R.Tuple())
            return bucket

    assert inflight_storage_conflicts(Unsafe["main"]) == [("handle", "late")]
