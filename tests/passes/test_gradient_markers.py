"""Gradient markers, the contract between the step builder and the distribution passes:
``R.call_pure_packed("raf_dist.mark_gradient", g, R.prim_value(i))`` says "g is the gradient of
parameter i". Pinned here: StripGradientMarkers turns every marker (in every function) into a
plain alias of its gradient and leaves other packed calls alone (Before / Expected); find_markers
reports each marker's variable, raw gradient, parameter index, binding position and size, in
backward order; mark_gradient builds exactly the marker the passes recognise; SubstituteVars
replaces both kinds of variables. No MPI, no compilation."""
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes.gradient_markers import (MARK_GRADIENT, StripGradientMarkers, SubstituteVars,
                                              find_markers, is_marker, mark_gradient,
                                              tensor_numel)


@I.ir_module
class Before:
    @R.function
    def train_step(x: R.Tensor((4,), "float32"), w1: R.Tensor((4,), "float32"),
                   w2: R.Tensor((2, 3), "float16")):
        with R.dataflow():
            loss = R.sum(R.multiply(x, w1))
            g2 = R.multiply(w2, R.const(2.0, "float16"))  # backward produces w2's gradient first
            m2 = R.call_pure_packed("raf_dist.mark_gradient", g2, R.prim_value(1),
                                    ty_args=R.Tensor((2, 3), "float16"))
            g1 = R.multiply(x, R.const(3.0, "float32"))
            # a packed call that is not a gradient marker: left alone
            d = R.call_pure_packed("raf_dist.dropout", g1, R.prim_value(0),
                                   ty_args=R.Tensor((4,), "float32"))
            m1 = R.call_pure_packed("raf_dist.mark_gradient", d, R.prim_value(0),
                                    ty_args=R.Tensor((4,), "float32"))
            new_w1 = R.subtract(w1, m1)
            new_w2 = R.subtract(w2, m2)
            out = (loss, new_w1, new_w2)
            R.output(out)
        return out

    @R.function
    def helper(g: R.Tensor((4,), "float32")):  # every function of the module is stripped
        with R.dataflow():
            m = R.call_pure_packed("raf_dist.mark_gradient", g, R.prim_value(0),
                                   ty_args=R.Tensor((4,), "float32"))
            R.output(m)
        return m


@I.ir_module
class Expected:
    @R.function
    def train_step(x: R.Tensor((4,), "float32"), w1: R.Tensor((4,), "float32"),
                   w2: R.Tensor((2, 3), "float16")):
        with R.dataflow():
            lv = R.multiply(x, w1)
            loss = R.sum(lv, axis=None, keepdims=False)
            g2 = R.multiply(w2, R.const(2.0, "float16"))
            m2 = g2
            g1 = R.multiply(x, R.const(3.0, "float32"))
            d = R.call_pure_packed("raf_dist.dropout", g1, R.prim_value(0),
                                   ty_args=R.Tensor((4,), "float32"))
            m1 = d
            new_w1 = R.subtract(w1, m1)
            new_w2 = R.subtract(w2, m2)
            out = (loss, new_w1, new_w2)
            R.output(out)
        return out

    @R.function
    def helper(g: R.Tensor((4,), "float32")):
        with R.dataflow():
            m = g
            R.output(m)
        return m


def test_strip_turns_every_marker_into_an_alias():
    tvm.ir.assert_structural_equal(StripGradientMarkers()(Before), Expected)


def test_strip_leaves_a_module_without_markers_unchanged():
    tvm.ir.assert_structural_equal(StripGradientMarkers()(Expected), Expected)


def test_find_markers_in_backward_order():
    markers = find_markers(Before["train_step"].body.blocks[0])
    # binding positions: lv 0, loss 1, g2 2, m2 3, g1 4, d 5, m1 6 (the normalized block)
    assert [(m.var.name, m.grad.name, m.param_index, m.position) for m in markers] == [
        ("m2", "g2", 1, 3), ("m1", "d", 0, 6)]
    assert [(m.numel, m.nbytes) for m in markers] == [(6, 12), (4, 16)]  # float16, float32


def test_find_markers_in_a_block_without_markers():
    assert find_markers(Expected["train_step"].body.blocks[0]) == []


def test_mark_gradient_builds_the_marker_the_passes_recognise():
    bb = relax.BlockBuilder()
    g = relax.Var("g", relax.TensorType((4,), "float32"))
    with bb.function("helper", [g]):
        with bb.dataflow():
            m = bb.emit_output(mark_gradient(g, 0), name_hint="m")
        bb.emit_func_output(m)
    tvm.ir.assert_structural_equal(bb.get()["helper"], Before["helper"])
    call = mark_gradient(g, 3)
    assert is_marker(call)
    assert call.args[0].global_symbol == MARK_GRADIENT == "raf_dist.mark_gradient"
    assert int(call.args[2].value) == 3
    tvm.ir.assert_structural_equal(relax.BlockBuilder().normalize(call).ty, g.ty)


def test_is_marker_rejects_other_calls():
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    other_symbol = relax.call_pure_packed("raf_dist.dropout", x, relax.prim_value(0),
                                          ty_args=x.ty)
    assert not is_marker(other_symbol)
    assert not is_marker(relax.op.add(x, x))
    assert not is_marker(x)


def test_substitute_vars_replaces_vars_and_dataflow_vars():
    a = relax.Var("a", relax.TensorType((2,), "float32"))
    b = relax.DataflowVar("b", relax.TensorType((2,), "float32"))
    c = relax.Var("c", relax.TensorType((2,), "float32"))
    a2 = relax.Var("a2", relax.TensorType((2,), "float32"))
    b2 = relax.Var("b2", relax.TensorType((2,), "float32"))
    out = SubstituteVars({a: a2, b: b2}).visit_expr(relax.Tuple([a, b, c, a]))
    assert [f.same_as(v) for f, v in zip(out.fields, [a2, b2, c, a2])] == [True] * 4
    call = SubstituteVars({b: b2}).visit_expr(relax.op.add(a, b))
    assert call.args[0].same_as(a) and call.args[1].same_as(b2)


@pytest.mark.parametrize("shape, numel", [((), 1), ((5,), 5), ((2, 3, 4), 24)])
def test_tensor_numel(shape, numel):
    assert tensor_numel(relax.TensorType(shape, "float32")) == numel
