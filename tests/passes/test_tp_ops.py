"""Megatron's tensor-parallel region boundaries as Relax ops and their lowering (passes/tp_ops.py).

``tp_copy`` (f) is the identity forward with ``tp_reduce`` as gradient; ``tp_reduce`` (g) is the
sum over the tp group forward, identity backward; ``tp_max`` the max over the group with a zero
gradient; ``tp_rank`` this rank's index (0-d int64) with a zero gradient. Pinned here: their
type inference, their registered gradients (directly and through TVM's Gradient pass), and
LowerTensorParallel (Before / Expected): f removed, g and max lowered to blocking
``raf_dist.ccl.allreduce`` calls on the given group, tp_rank to the runtime's
``raf_dist.tp_rank_tensor(like, group)``. No MPI, no compilation."""
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes.tp_ops import (TP_COPY, TP_MAX, TP_RANK, TP_REDUCE, LowerTensorParallel,
                                    is_tp_op, tp_copy, tp_max, tp_rank, tp_reduce)

F32 = "float32"


def _forward():
    """x -> f -> matmul(w) -> g -> (minus the tp max) -> sum, and the tp rank (as a value)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4), F32))
    w = relax.Var("w", relax.TensorType((4, 3), F32))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            a = bb.emit(tp_copy(x), "a")
            b = bb.emit(relax.op.matmul(a, w), "b")
            c = bb.emit(tp_reduce(b), "c")
            m = bb.emit(tp_max(c), "m")
            r = bb.emit(tp_rank(c), "r")
            d = bb.emit(relax.op.subtract(c, m), "d")
            loss = bb.emit(relax.op.sum(d), "loss")
            out = bb.emit_output(relax.Tuple([loss, r]), "out")
        bb.emit_func_output(out)
    return bb.get()


@I.ir_module
class Expected:
    @R.function(pure=False)
    def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 3), "float32")):
        with R.dataflow():
            a = x  # f: the identity
            b = R.matmul(a, w)
            c = R.builtin.alloc_tensor(R.shape([2, 3]), R.dtype("float32"), 0, R.str("global"))
            R.output(b, c)
        R.call_packed("raf_dist.ccl.allreduce", b, R.str("sum"), 3, c, ty_args=(R.Tuple,))
        with R.dataflow():
            m = R.builtin.alloc_tensor(R.shape([2, 3]), R.dtype("float32"), 0, R.str("global"))
            R.output(m)
        R.call_packed("raf_dist.ccl.allreduce", c, R.str("max"), 3, m, ty_args=(R.Tuple,))
        with R.dataflow():
            r = R.call_pure_packed("raf_dist.tp_rank_tensor", c, R.prim_value(3),
                                   ty_args=R.Tensor((), "int64"))
            d = R.subtract(c, m)
            loss = R.sum(d)
            out = (loss, r)
            R.output(out)
        return out


def test_lower_tensor_parallel():
    tvm.ir.assert_structural_equal(LowerTensorParallel(group=3)(_forward()), Expected)


def test_lowering_leaves_a_module_without_tp_ops_unchanged():
    @I.ir_module
    class Plain:
        @R.function
        def main(x: R.Tensor((2,), "float32")):
            with R.dataflow():
                y = R.add(x, x)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(LowerTensorParallel(0)(Plain), Plain)


def test_type_inference():
    func = _forward()["main"]
    types = {b.var.name: b.var.ty for b in func.body.blocks[0].bindings}
    tvm.ir.assert_structural_equal(types["a"], relax.TensorType((2, 4), F32))
    tvm.ir.assert_structural_equal(types["c"], relax.TensorType((2, 3), F32))
    tvm.ir.assert_structural_equal(types["m"], relax.TensorType((2, 3), F32))
    tvm.ir.assert_structural_equal(types["r"], relax.TensorType((), "int64"))


@pytest.mark.parametrize("name", [TP_COPY, TP_REDUCE, TP_MAX, TP_RANK])
def test_ops_are_pure(name):
    assert bool(tvm.ir.Op.get(name).get_attr("FPurity"))


def test_registered_gradients():
    x = relax.Var("x", relax.TensorType((2, 4), F32))
    grad = relax.Var("grad", relax.TensorType((2, 4), F32))
    out = relax.Var("y", relax.TensorType((2, 4), F32))

    def gradient(name, call, output_grad):
        return list(tvm.ir.Op.get(name).get_attr("FPrimalGradient")(out, call, output_grad, None))

    [copy_grad] = gradient(TP_COPY, tp_copy(x), grad)  # f's backward is g
    assert is_tp_op(copy_grad, TP_REDUCE) and copy_grad.args[0].same_as(grad)
    [reduce_grad] = gradient(TP_REDUCE, tp_reduce(x), grad)  # g's backward is the identity
    assert reduce_grad.same_as(grad)
    [max_grad] = gradient(TP_MAX, tp_max(x), grad)  # no gradient through the shift
    tvm.ir.assert_structural_equal(max_grad, relax.op.zeros_like(grad))
    rank_grad = relax.Var("rank_grad", relax.TensorType((), "int64"))
    [rank_input_grad] = gradient(TP_RANK, tp_rank(x), rank_grad)  # zeros of the input's type
    tvm.ir.assert_structural_equal(rank_input_grad, relax.op.zeros_like(x))


def test_gradient_pass_emits_the_backward_reduce_by_itself():
    """TVM's Gradient pass differentiates through the ops: x's gradient is g of a's."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4), F32))
    w = relax.Var("w", relax.TensorType((4, 3), F32))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            a = bb.emit(tp_copy(x), "a")
            c = bb.emit(tp_reduce(bb.emit(relax.op.matmul(a, w), "b")), "c")
            loss = bb.emit_output(relax.op.sum(bb.emit(relax.op.subtract(c, bb.emit(
                tp_max(c), "m")), "d")), "loss")
        bb.emit_func_output(loss)
    adjoint = relax.transform.Gradient("main")(bb.get())["main_adjoint"]
    bound = {b.var.name: b.value for b in adjoint.body.blocks[0].bindings}
    assert is_tp_op(bound["x_adjoint"], TP_REDUCE)
    assert bound["x_adjoint"].args[0].name == "a_adjoint"
    assert isinstance(bound["b_adjoint"], relax.Var)  # g's backward: an alias, no collective
    ops = [v.op.name for v in bound.values()
           if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)]
    assert (ops.count(TP_COPY), ops.count(TP_REDUCE), ops.count(TP_MAX)) == (1, 2, 1)


def test_is_tp_op():
    x = relax.Var("x", relax.TensorType((2,), F32))
    assert all(is_tp_op(c) for c in (tp_copy(x), tp_reduce(x), tp_max(x), tp_rank(x)))
    assert is_tp_op(tp_copy(x), TP_COPY) and not is_tp_op(tp_copy(x), TP_REDUCE)
    assert not is_tp_op(relax.op.add(x, x))
    assert not is_tp_op(x)
