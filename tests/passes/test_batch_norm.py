"""DecomposeBatchNorm: training-mode ``R.nn.batch_norm`` as primitive ops with PyTorch's
train-mode semantics, optionally synchronized over W data-parallel ranks (SyncBatchNorm).

Pinned here (Before / Expected): the two-pass statistics over the n = 4 values per channel of
a [2, 3, 2] input (mean = sum / N, var = sum(centered^2) / N, y = centered * rsqrt(var + eps) *
gamma + beta), the running statistics blended with momentum 0.1, the running variance
unbiased (x N / (N - 1) = 4/3), and with W = 2 the per-channel sums allreduced and N = 8
(8/7). Also: momentum 1 (the batch statistics themselves), no scale / no center, a negative
axis, inference-mode batch norm left alone, the refusal of a single value per channel, the
bad world size, the allreduce's registered gradient, and decompose_forward touching only the
training forward. No MPI, no compilation."""
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.model import Model
from raf_dist.passes.batch_norm import (DecomposeBatchNorm, decompose_forward,
                                        has_training_batch_norm)


@I.ir_module
class Before:
    @R.function
    def forward(x: R.Tensor((2, 3, 2), "float32"), gamma: R.Tensor((3,), "float32"),
                beta: R.Tensor((3,), "float32"), mean: R.Tensor((3,), "float32"),
                var: R.Tensor((3,), "float32")):
        with R.dataflow():
            bn = R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, epsilon=1e-5,
                                 momentum=0.1, training=True)
            y = bn[0]
            R.output(bn, y)
        return (y, bn[1], bn[2])


@I.ir_module
class Expected:
    @R.function
    def forward(x: R.Tensor((2, 3, 2), "float32"), gamma: R.Tensor((3,), "float32"),
                beta: R.Tensor((3,), "float32"), mean: R.Tensor((3,), "float32"),
                var: R.Tensor((3,), "float32")):
        with R.dataflow():
            total = R.sum(x, axis=[0, 2], keepdims=True)
            batch_mean = R.divide(total, R.const(4.0, "float32"))  # N = 2 * 2 per channel
            centered = R.subtract(x, batch_mean)
            squares = R.multiply(centered, centered)
            total_sq = R.sum(squares, axis=[0, 2], keepdims=True)
            batch_var = R.divide(total_sq, R.const(4.0, "float32"))  # biased, to normalize
            shifted = R.add(batch_var, R.const(1e-5, "float32"))
            rstd = R.rsqrt(shifted)
            normed = R.multiply(centered, rstd)
            g = R.reshape(gamma, R.shape([1, 3, 1]))
            scaled = R.multiply(normed, g)
            b = R.reshape(beta, R.shape([1, 3, 1]))
            out = R.add(scaled, b)
            mean3 = R.reshape(batch_mean, R.shape([3]))
            var3 = R.reshape(batch_var, R.shape([3]))
            unbiased = R.multiply(var3, R.const(4.0 / 3.0, "float32"))  # N / (N - 1)
            kept_mean = R.multiply(mean, R.const(0.9, "float32"))
            new_mean = R.add(kept_mean, R.multiply(mean3, R.const(0.1, "float32")))
            kept_var = R.multiply(var, R.const(0.9, "float32"))
            new_var = R.add(kept_var, R.multiply(unbiased, R.const(0.1, "float32")))
            bn = (out, new_mean, new_var)
            y = bn[0]
            R.output(bn, y)
        return (y, bn[1], bn[2])


@I.ir_module
class ExpectedSync2:
    @R.function
    def forward(x: R.Tensor((2, 3, 2), "float32"), gamma: R.Tensor((3,), "float32"),
                beta: R.Tensor((3,), "float32"), mean: R.Tensor((3,), "float32"),
                var: R.Tensor((3,), "float32")):
        with R.dataflow():
            local = R.sum(x, axis=[0, 2], keepdims=True)
            total = R.ccl.allreduce(local, "sum", True)  # the global batch's sum
            batch_mean = R.divide(total, R.const(8.0, "float32"))  # N = 4 values per channel x 2 ranks
            centered = R.subtract(x, batch_mean)
            squares = R.multiply(centered, centered)
            local_sq = R.sum(squares, axis=[0, 2], keepdims=True)
            total_sq = R.ccl.allreduce(local_sq, "sum", True)  # deviations from the global mean
            batch_var = R.divide(total_sq, R.const(8.0, "float32"))
            shifted = R.add(batch_var, R.const(1e-5, "float32"))
            rstd = R.rsqrt(shifted)
            normed = R.multiply(centered, rstd)
            g = R.reshape(gamma, R.shape([1, 3, 1]))
            scaled = R.multiply(normed, g)
            b = R.reshape(beta, R.shape([1, 3, 1]))
            out = R.add(scaled, b)
            mean3 = R.reshape(batch_mean, R.shape([3]))
            var3 = R.reshape(batch_var, R.shape([3]))
            unbiased = R.multiply(var3, R.const(8.0 / 7.0, "float32"))
            kept_mean = R.multiply(mean, R.const(0.9, "float32"))
            new_mean = R.add(kept_mean, R.multiply(mean3, R.const(0.1, "float32")))
            kept_var = R.multiply(var, R.const(0.9, "float32"))
            new_var = R.add(kept_var, R.multiply(unbiased, R.const(0.1, "float32")))
            bn = (out, new_mean, new_var)
            y = bn[0]
            R.output(bn, y)
        return (y, bn[1], bn[2])


def test_decompose():
    tvm.ir.assert_structural_equal(DecomposeBatchNorm()(Before), Expected)


def test_decompose_synchronized_over_two_ranks():
    tvm.ir.assert_structural_equal(DecomposeBatchNorm(sync_world_size=2)(Before), ExpectedSync2)


def test_momentum_one_no_affine_negative_axis():
    """Momentum 1: the running statistics are the batch's (no blend); scale / center off: no
    gamma, no beta; axis -1 of a [4, 2] input: 4 values per channel, unbiased x 4/3."""
    @I.ir_module
    class Plain:
        @R.function
        def forward(x: R.Tensor((4, 2), "float32"), gamma: R.Tensor((2,), "float32"),
                    beta: R.Tensor((2,), "float32"), mean: R.Tensor((2,), "float32"),
                    var: R.Tensor((2,), "float32")):
            with R.dataflow():
                bn = R.nn.batch_norm(x, gamma, beta, mean, var, axis=-1, epsilon=0.5,
                                     center=False, scale=False, momentum=1.0, training=True)
                R.output(bn)
            return bn

    @I.ir_module
    class ExpectedPlain:
        @R.function
        def forward(x: R.Tensor((4, 2), "float32"), gamma: R.Tensor((2,), "float32"),
                    beta: R.Tensor((2,), "float32"), mean: R.Tensor((2,), "float32"),
                    var: R.Tensor((2,), "float32")):
            with R.dataflow():
                batch_mean = R.divide(R.sum(x, axis=[0], keepdims=True), R.const(4.0, "float32"))
                centered = R.subtract(x, batch_mean)
                batch_var = R.divide(R.sum(R.multiply(centered, centered), axis=[0], keepdims=True),
                                     R.const(4.0, "float32"))
                out = R.multiply(centered, R.rsqrt(R.add(batch_var, R.const(0.5, "float32"))))
                mean2 = R.reshape(batch_mean, R.shape([2]))
                var2 = R.multiply(R.reshape(batch_var, R.shape([2])), R.const(4.0 / 3.0, "float32"))
                bn = (out, mean2, var2)
                R.output(bn)
            return bn

    tvm.ir.assert_structural_equal(DecomposeBatchNorm()(Plain), ExpectedPlain)


@I.ir_module
class Inference:
    @R.function
    def forward(x: R.Tensor((2, 3), "float32"), gamma: R.Tensor((3,), "float32"),
                beta: R.Tensor((3,), "float32"), mean: R.Tensor((3,), "float32"),
                var: R.Tensor((3,), "float32")):
        with R.dataflow():
            bn = R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=False)
            y = bn[0]
            R.output(y)
        return y


def test_inference_batch_norm_is_left_alone():
    assert not has_training_batch_norm(Inference)
    assert has_training_batch_norm(Before)
    tvm.ir.assert_structural_equal(DecomposeBatchNorm(2)(Inference), Inference)


@I.ir_module
class OneRow:
    @R.function
    def forward(x: R.Tensor((1, 3), "float32"), gamma: R.Tensor((3,), "float32"),
                beta: R.Tensor((3,), "float32"), mean: R.Tensor((3,), "float32"),
                var: R.Tensor((3,), "float32")):
        with R.dataflow():
            bn = R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=True)
            R.output(bn)
        return bn


def test_one_value_per_channel_is_refused():
    with pytest.raises(ValueError, match="over 1 value per channel"):
        DecomposeBatchNorm()(OneRow)


def test_one_row_per_rank_is_fine_when_synchronized():
    """SyncBatchNorm over 2 ranks of one row: 2 values per channel, unbiased x 2/1."""
    func = DecomposeBatchNorm(2)(OneRow)["forward"]
    calls = [b.value for b in func.body.blocks[0].bindings if isinstance(b.value, relax.Call)]

    def constants(op_name):
        return [float(c.args[1].value.numpy()) for c in calls if c.op.name == op_name
                and isinstance(c.args[1], tvm.ir.expr.Constant)]

    assert constants("relax.divide") == [2.0, 2.0]  # mean and variance over N = 1 x 2
    # the unbiased running variance (x 2/1), then the momentum blends (0.9, 0.1 twice)
    assert constants("relax.multiply") == pytest.approx([2.0, 0.9, 0.1, 0.9, 0.1])


@pytest.mark.parametrize("world", [0, -1])
def test_bad_world_size(world):
    with pytest.raises(ValueError, match="sync_world_size must be >= 1"):
        DecomposeBatchNorm(world)


def test_allreduce_gradient_is_the_allreduce_of_the_output_gradient():
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    out = relax.Var("y", relax.TensorType((3,), "float32"))
    grad = relax.Var("grad", relax.TensorType((3,), "float32"))
    gradient = tvm.ir.Op.get("relax.ccl.allreduce").get_attr("FPrimalGradient")
    for op_type in ("sum", "avg"):
        [x_grad] = gradient(out, relax.op.ccl.allreduce(x, op_type, True), grad, None)
        tvm.ir.assert_structural_equal(x_grad, relax.op.ccl.allreduce(grad, op_type, True))
    with pytest.raises(Exception, match=r"no gradient for allreduce\(max\)"):
        gradient(out, relax.op.ccl.allreduce(x, "max", True), grad, None)


def test_decompose_forward_touches_only_the_training_forward():
    mod = tvm.IRModule({"forward": Before["forward"], "forward_eval": Inference["forward"]})
    init = {n: np.ones(3, "float32") for n in ("gamma", "beta")}
    model = Model(mod=mod, input_specs=[((2, 3, 2), "float32")], param_names=["gamma", "beta"],
                  init_params=init)
    out = decompose_forward(model, sync_world_size=2)
    tvm.ir.assert_structural_equal(out.mod["forward"], ExpectedSync2["forward"])
    assert out.mod["forward_eval"].same_as(Inference["forward"])
    assert out.param_names == ["gamma", "beta"] and out.init_params is init
    assert model.mod["forward"].same_as(Before["forward"])  # the model given is not changed
