"""IR tier for AllReduceGradients: bucket assignment, and collective placement with and
without overlap (TVMScript Before / Expected, structural equality). No MPI."""
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes import (AllReduceGradients, StripGradientMarkers, assign_buckets,
                             bucket_layout)


@pytest.mark.parametrize("sizes, bucket, expected", [
    ([16, 16, 16], 16, [[0], [1], [2]]),
    ([16, 16, 16], 32, [[0, 1], [2]]),
    ([16, 16, 16], 1000, [[0, 1, 2]]),
    ([4, 100, 4, 4], 50, [[0, 1], [2, 3]]),
    ([], 16, []),
])
def test_assign_buckets(sizes, bucket, expected):
    assert assign_buckets(sizes, bucket) == expected


@pytest.mark.parametrize("numels, elem_bytes, offsets, total", [
    ([5, 160, 32], 4, [0, 16, 176], 208),  # float32: offsets are multiples of 16 elements
    ([16, 16], 4, [0, 16], 32),  # aligned sizes need no padding
    ([3, 1], 8, [0, 8], 9),  # float64: multiples of 8 elements
    ([7, 2], 2, [0, 32], 34),  # float16: multiples of 32 elements
    ([], 4, [], 0),
])
def test_bucket_layout_aligns_every_gradient_to_64_bytes(numels, elem_bytes, offsets, total):
    assert bucket_layout(numels, elem_bytes) == (offsets, total)


@I.ir_module
class Before:
    @R.function
    def train_step(x: R.Tensor((4,), "float32"), w1: R.Tensor((4,), "float32"),
                   w2: R.Tensor((2, 2), "float32")):
        with R.dataflow():
            loss = R.sum(R.multiply(x, w1))
            g2 = R.multiply(w2, R.const(2.0, "float32"))  # backward produces w2's gradient first
            m2 = R.call_pure_packed("raf_dist.mark_gradient", g2, R.prim_value(1),
                                    ty_args=R.Tensor((2, 2), "float32"))
            g1 = R.multiply(x, R.const(3.0, "float32"))
            m1 = R.call_pure_packed("raf_dist.mark_gradient", g1, R.prim_value(0),
                                    ty_args=R.Tensor((4,), "float32"))
            new_w1 = R.subtract(w1, m1)
            new_w2 = R.subtract(w2, m2)
            out = (loss, new_w1, new_w2)
            R.output(out)
        return out


def test_overlap_starts_each_bucket_early_and_waits_at_first_use():
    @I.ir_module
    class Expected:
        @R.function(pure=False)
        def train_step(x: R.Tensor((4,), "float32"), w1: R.Tensor((4,), "float32"),
                       w2: R.Tensor((2, 2), "float32")):
            with R.dataflow():
                lv = R.multiply(x, w1)
                loss = R.sum(lv, axis=None, keepdims=False)
                g2 = R.multiply(w2, R.const(2.0, "float32"))
                bucket0 = R.call_pure_packed("raf_dist.bucket.pack", g2, R.shape([0]), R.prim_value(4),
                                             ty_args=R.Tensor((4,), "float32"))
                R.output(loss, bucket0)
            handle0: R.Prim("int64") = R.call_packed("raf_dist.ccl.allreduce_start", bucket0, R.str("avg"), 0,
                                             bucket0, ty_args=R.Prim("int64"))
            with R.dataflow():
                g1 = R.multiply(x, R.const(3.0, "float32"))  # backward continues meanwhile
                bucket1 = R.call_pure_packed("raf_dist.bucket.pack", g1, R.shape([0]), R.prim_value(4),
                                             ty_args=R.Tensor((4,), "float32"))
                R.output(bucket1)
            handle1: R.Prim("int64") = R.call_packed("raf_dist.ccl.allreduce_start", bucket1, R.str("avg"), 0,
                                             bucket1, ty_args=R.Prim("int64"))
            R.call_packed("raf_dist.ccl.wait", handle1, bucket1, ty_args=(R.Tuple,))
            with R.dataflow():
                m1 = R.call_pure_packed("raf_dist.bucket.view", bucket1, R.prim_value(0), R.shape([4]),
                                        R.prim_value(0), ty_args=R.Tensor((4,), "float32"))
                new_w1 = R.subtract(w1, m1)
                R.output(new_w1)
            R.call_packed("raf_dist.ccl.wait", handle0, bucket0, ty_args=(R.Tuple,))
            with R.dataflow():
                m2 = R.call_pure_packed("raf_dist.bucket.view", bucket0, R.prim_value(0), R.shape([2, 2]),
                                        R.prim_value(0), ty_args=R.Tensor((2, 2), "float32"))
                new_w2 = R.subtract(w2, m2)
                out = (loss, new_w1, new_w2)
                R.output(out)
            R.call_packed("raf_dist.ccl.allreduce", loss, R.str("avg"), 0, loss, ty_args=(R.Tuple,))
            return out

    tvm.ir.assert_structural_equal(AllReduceGradients(2, 16, overlap=True)(Before), Expected)


def test_serial_reduces_one_bucket_after_backward():
    @I.ir_module
    class Expected:
        @R.function(pure=False)
        def train_step(x: R.Tensor((4,), "float32"), w1: R.Tensor((4,), "float32"),
                       w2: R.Tensor((2, 2), "float32")):
            with R.dataflow():
                lv = R.multiply(x, w1)
                loss = R.sum(lv, axis=None, keepdims=False)
                g2 = R.multiply(w2, R.const(2.0, "float32"))
                g1 = R.multiply(x, R.const(3.0, "float32"))
                # backward order (w2 first); each gradient at a 64-byte aligned offset
                bucket0 = R.call_pure_packed("raf_dist.bucket.pack", g2, g1, R.shape([0, 16]),
                                             R.prim_value(20), ty_args=R.Tensor((20,), "float32"))
                R.output(loss, bucket0)
            R.call_packed("raf_dist.ccl.allreduce", bucket0, R.str("avg"), 0, bucket0, ty_args=(R.Tuple,))
            with R.dataflow():
                m2 = R.call_pure_packed("raf_dist.bucket.view", bucket0, R.prim_value(0), R.shape([2, 2]),
                                        R.prim_value(0), ty_args=R.Tensor((2, 2), "float32"))
                m1 = R.call_pure_packed("raf_dist.bucket.view", bucket0, R.prim_value(16), R.shape([4]),
                                        R.prim_value(0), ty_args=R.Tensor((4,), "float32"))
                new_w1 = R.subtract(w1, m1)
                new_w2 = R.subtract(w2, m2)
                out = (loss, new_w1, new_w2)
                R.output(out)
            R.call_packed("raf_dist.ccl.allreduce", loss, R.str("avg"), 0, loss, ty_args=(R.Tuple,))
            return out

    tvm.ir.assert_structural_equal(AllReduceGradients(2, 1000, overlap=False)(Before), Expected)


def test_world_of_one_only_strips_markers():
    tvm.ir.assert_structural_equal(AllReduceGradients(1, 16)(Before), StripGradientMarkers()(Before))


@pytest.mark.parametrize("bucket_bytes, buckets", [(16, 2), (32, 1), (1 << 20, 1)])
def test_one_start_per_bucket(bucket_bytes, buckets):
    func = AllReduceGradients(4, bucket_bytes, overlap=True)(Before)["train_step"]
    calls = [b.value.op.global_symbol
             for block in func.body.blocks for b in block.bindings
             if isinstance(b.value, tvm.relax.Call) and isinstance(b.value.op, tvm.relax.ExternFunc)]
    assert calls.count("raf_dist.ccl.allreduce_start") == buckets
    assert calls.count("raf_dist.ccl.wait") == buckets
    assert calls.count("raf_dist.ccl.allreduce") == 1  # the loss


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        AllReduceGradients(2, 0)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        AllReduceGradients(0, 16)
