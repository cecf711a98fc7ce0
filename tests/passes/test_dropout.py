"""Dropout with seeded masks that the host supplies (frontend/dropout.py, formerly
passes/dropout.py): the PyTorch frontend leaves each dropout as a marker
``R.call_pure_packed("raf_dist.dropout", x, R.prim_value(i))``; ``dropout_masks_as_inputs``
turns marker i into ``x * dropout_mask<i>`` and inserts the masks as arguments right after the
model's inputs: forward(*inputs, *params) -> forward(*inputs, *masks, *params).

Pinned here (Before / Expected): the argument order (one and two inputs), that the mask is
chosen by the marker's index and not by its position, that each mask has its marker's type,
that the function's attributes are kept, that a function without markers keeps its body, and
that ``dropout_marker`` builds the marker the rewrite recognises. No MPI, no compilation."""
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.frontend.dropout import dropout_masks_as_inputs
from raf_dist.ir.ops import dropout_marker


@I.ir_module
class Before:
    @R.function
    def forward(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 3), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            # the second dropout in execution order carries index 1, the first index 0; the
            # markers are listed here out of order on purpose: the index picks the mask
            h = R.matmul(x, w)
            d1 = R.call_pure_packed("raf_dist.dropout", h, R.prim_value(1),
                                    ty_args=R.Tensor((2, 3), "float32"))
            d0 = R.call_pure_packed("raf_dist.dropout", x, R.prim_value(0),
                                    ty_args=R.Tensor((2, 4), "float32"))
            s = R.sum(d0, axis=[1], keepdims=True)
            out = R.add(d1, s)
            R.output(out)
        return out


@I.ir_module
class Expected:
    @R.function
    def forward(x: R.Tensor((2, 4), "float32"), dropout_mask0: R.Tensor((2, 4), "float32"),
                dropout_mask1: R.Tensor((2, 3), "float32"), w: R.Tensor((4, 3), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.matmul(x, w)
            d1 = R.multiply(h, dropout_mask1)  # inverted dropout: the mask holds 0 or 1/(1-p)
            d0 = R.multiply(x, dropout_mask0)
            s = R.sum(d0, axis=[1], keepdims=True)
            out = R.add(d1, s)
            R.output(out)
        return out


MASK_TYPES = [relax.TensorType((2, 4), "float32"), relax.TensorType((2, 3), "float32")]


def test_markers_become_multiplies_by_mask_inputs():
    after = dropout_masks_as_inputs(Before["forward"], 1, MASK_TYPES)
    tvm.ir.assert_structural_equal(tvm.IRModule({"forward": after}), Expected)


def test_masks_follow_every_input():
    @I.ir_module
    class TwoInputs:
        @R.function
        def forward(x: R.Tensor((3,), "float16"), y: R.Tensor((3,), "float16"),
                    w: R.Tensor((3,), "float16")):
            with R.dataflow():
                d = R.call_pure_packed("raf_dist.dropout", R.add(x, y), R.prim_value(0),
                                       ty_args=R.Tensor((3,), "float16"))
                out = R.multiply(d, w)
                R.output(out)
            return out

    @I.ir_module
    class ExpectedTwoInputs:
        @R.function
        def forward(x: R.Tensor((3,), "float16"), y: R.Tensor((3,), "float16"),
                    dropout_mask0: R.Tensor((3,), "float16"), w: R.Tensor((3,), "float16")):
            with R.dataflow():
                d = R.multiply(R.add(x, y), dropout_mask0)
                out = R.multiply(d, w)
                R.output(out)
            return out

    after = dropout_masks_as_inputs(TwoInputs["forward"], 2,
                                    [relax.TensorType((3,), "float16")])
    tvm.ir.assert_structural_equal(tvm.IRModule({"forward": after}), ExpectedTwoInputs)
    assert [p.name for p in after.params] == ["x", "y", "dropout_mask0", "w"]


def test_function_without_markers_keeps_its_body():
    func = Expected["forward"]
    after = dropout_masks_as_inputs(func, 4, [])
    tvm.ir.assert_structural_equal(after, func)


def test_dropout_marker_builds_the_marker_the_rewrite_recognises():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4), "float32"))
    w = relax.Var("w", relax.TensorType((4, 3), "float32"))
    with bb.function("forward", [x, w], attrs={"num_input": 1}):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, w), "h")
            d1 = bb.emit(dropout_marker(h, 1), "d1")
            d0 = bb.emit(dropout_marker(x, 0), "d0")
            s = bb.emit(relax.op.sum(d0, axis=[1], keepdims=True), "s")
            out = bb.emit_output(relax.op.add(d1, s), "out")
        bb.emit_func_output(out)
    built = bb.get()
    tvm.ir.assert_structural_equal(built, Before)
    after = dropout_masks_as_inputs(built["forward"], 1, MASK_TYPES)
    tvm.ir.assert_structural_equal(tvm.IRModule({"forward": after}), Expected)
