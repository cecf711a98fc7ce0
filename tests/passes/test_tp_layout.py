"""tp_layout: where each value of a forward graph is split across T tensor-parallel ranks. A
split value keeps one rank digit of its row-major flat index, named by ``hi`` (the flat stride
just above the digit); ``propagate`` follows the split from the placed parameters, one rule per
op, and stops with Unsplittable / Request / Resegment for the search to answer.

Pinned here against hand-computed values: the index arithmetic (strides, dim_of, hi_of,
local_shape), the layouts of a two-layer MLP split Megatron's way (column then row parallel:
the split of every value, the row layer's partial sum, the f before the input's cast) reached
by answering the Requests one after the other, a fused qkv weight (Resegment into 3 segments),
a vocabulary-parallel embedding, a split output allowed only for a vocabulary-parallel loss,
and the Unsplittable reasons (softmax / sum over the split dimension, an unknown op, a reshape
that cuts the digit, a placement that does not divide, a weight split along the contracted
dimension alone). An analysis only: no rewrite, no MPI, no compilation."""
import numpy as np
import pytest
import tvm
import tvm.tirx
from tvm import relax
from tvm.script import relax as R

from raf_dist.passes.tp_layout import (PARTIAL, Request, Resegment, Unsplittable, dim_of,
                                       field_shapes, hi_of, local_shape, propagate,
                                       static_shape, strides)


# ---- index arithmetic ----------------------------------------------------------------------
def test_strides():
    assert strides([2, 3, 4]) == [12, 4, 1]
    assert strides([5]) == [1]
    assert strides([]) == []


@pytest.mark.parametrize("shape, hi, tp, expected", [
    ((4, 16), 16, 2, (1, 16)),  # columns: 8 consecutive elements of each row per rank
    ((16, 8), 128, 2, (0, 16)),  # rows of a [16, 8] weight
    ((16, 8), 128, 4, (0, 16)),  # hi does not depend on T
    ((8, 8), 16, 2, (0, 2)),  # [4, 16] split by columns, seen as [8, 8]: rows alternate
    ((4, 24), 8, 2, (1, 8)),  # 3 segments of 8 along dim 1 (a fused qkv), each split 2 ways
    ((4, 2, 8), 16, 4, None),  # 4 elements per rank straddle dims 1 and 2
    ((4, 16), 3, 2, None),  # the digit is not a multiple of T
])
def test_dim_of(shape, hi, tp, expected):
    assert dim_of(shape, hi, tp) == expected


@pytest.mark.parametrize("shape, dim, size, hi", [
    ((4, 16), 1, 16, 16), ((16, 8), 0, 16, 128), ((4, 24), 1, 8, 8), ((2, 4, 4), 1, 4, 16)])
def test_hi_of(shape, dim, size, hi):
    assert hi_of(shape, dim, size) == hi
    assert dim_of(shape, hi, 2) == (dim, size)  # and back


@pytest.mark.parametrize("shape, hi, tp, local", [
    ((4, 24), 8, 2, (4, 12)), ((16, 8), 128, 2, (8, 8)), ((16, 8), 128, 4, (4, 8)),
    ((3, 5), None, 2, (3, 5))])
def test_local_shape(shape, hi, tp, local):
    assert local_shape(shape, hi, tp) == local


def test_static_and_field_shapes():
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    n = relax.Var("n", relax.ShapeType(ndim=1))
    symbolic = relax.Var("y", relax.TensorType([tvm.tirx.Var("rows", "int64"), 3], "float32"))
    t = relax.Var("t", relax.TupleType([relax.TensorType((2,), "float32"),
                                        relax.TensorType((4, 1), "float16")]))
    assert static_shape(x) == (2, 3)
    assert static_shape(n) is None
    assert static_shape(symbolic) is None
    assert static_shape(t) is None
    assert field_shapes(t) == [(2,), (4, 1)]


# ---- propagation: Megatron's MLP ---------------------------------------------------------
@R.function
def mlp(x: R.Tensor((4, 8), "float32"), s: R.Tensor((8,), "float32"),
        w1: R.Tensor((16, 8), "float32"), b1: R.Tensor((16,), "float32"),
        w2: R.Tensor((8, 16), "float32"), b2: R.Tensor((8,), "float32")):
    with R.dataflow():
        xs = R.multiply(x, s)  # a trained, replicated scale: the gradient flows through xs
        xc = R.astype(xs, "float32")  # a cast between it and the split layer
        w1t = R.permute_dims(w1, axes=[1, 0])
        h = R.matmul(xc, w1t)  # column parallel
        hb = R.add(b1, h)
        r = R.nn.relu(hb)
        w2t = R.permute_dims(w2, axes=[1, 0])
        o = R.matmul(r, w2t)  # row parallel: this rank's partial sum
        out = R.add(b2, o)
        R.output(out)
    return out


def _vars(func):
    out = {p.name: p for p in func.params}
    out.update({b.var.name: b.var for block in func.body.blocks for b in block.bindings})
    return out


def _params(func):
    return set(func.params[1:])


def _needs_grad(func, names):
    v = _vars(func)
    return {v[n] for n in names}


MLP_NEEDS_GRAD = ["s", "w1", "b1", "w2", "b2", "xs", "xc", "w1t", "h", "hb", "r", "w2t", "o",
                  "out"]


def _mlp_propagate(tp, placements):
    v = _vars(mlp)
    return propagate(mlp, tp, {v[n]: p for n, p in placements.items()}, _params(mlp),
                     _needs_grad(mlp, MLP_NEEDS_GRAD))


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_requests_the_bias_then_the_row_weight_then_settles(tp):
    with pytest.raises(Request) as request:  # h's columns meet b1 in the add
        _mlp_propagate(tp, {"w1": (0, 16)})
    assert (request.value.param.name, request.value.dim, request.value.size) == ("b1", 0, 16)
    with pytest.raises(Request) as request:  # r's split features meet w2's input dimension
        _mlp_propagate(tp, {"w1": (0, 16), "b1": (0, 16)})
    assert (request.value.param.name, request.value.dim, request.value.size) == ("w2", 1, 16)
    result = _mlp_propagate(tp, {"w1": (0, 16), "b1": (0, 16), "w2": (1, 16)})
    assert {var.name: hi for var, hi in result.layouts.items()} == {
        "w1": 128,  # [16, 8] rows: 16 * 8
        "b1": 16, "w1t": 16, "h": 16, "hb": 16, "r": 16,  # the 16 features
        "w2": 16,  # [8, 16] columns
        "w2t": 128,  # [16, 8] rows
    }
    assert {var.name for var in result.partials} == {"o"}
    # f goes on xs, before the cast, for the replicated input of the column layer
    assert {k.name: v.name for k, v in result.copies.items()} == {"xc": "xs"}
    assert result.vocab_takes == set() and result.output_split is False
    v = _vars(mlp)
    assert [local_shape(static_shape(v[n]), result.layouts[v[n]], tp)
            for n in ("w1", "h", "w2")] == [(16 // tp, 8), (4, 16 // tp), (8, 16 // tp)]


def test_mlp_without_gradient_to_the_input_needs_no_copy():
    v = _vars(mlp)
    result = propagate(mlp, 2, {v["w1"]: (0, 16), v["b1"]: (0, 16), v["w2"]: (1, 16)},
                       _params(mlp), set())
    assert result.copies == {}


def test_weight_split_along_the_contracted_dimension_alone():
    with pytest.raises(Unsplittable, match="o: the weight is split along the contracted "
                                           "dimension but the activation is not"):
        _mlp_propagate(2, {"w2": (1, 16)})


@pytest.mark.parametrize("tp, placement, why", [
    (2, (0, 5), r"w1: dimension 0 \(16\) of \[16, 8\] does not split into 2 equal parts per "
                r"segment of 5"),
    (3, (0, 16), r"w1: dimension 0 \(16\) of \[16, 8\] does not split into 3 equal parts"),
])
def test_placement_that_does_not_divide(tp, placement, why):
    with pytest.raises(Unsplittable, match=why) as stop:
        _mlp_propagate(tp, {"w1": placement})
    assert stop.value.var.name == "w1"


# ---- a fused qkv projection: Resegment --------------------------------------------------
@R.function
def qkv(x: R.Tensor((4, 8), "float32"), wqkv: R.Tensor((24, 8), "float32"),
        wo: R.Tensor((6, 8), "float32")):
    with R.dataflow():
        wt = R.permute_dims(wqkv, axes=[1, 0])
        fused = R.matmul(x, wt)
        parts = R.split(fused, 3, axis=1)
        q = parts[0]
        k = parts[1]
        v = parts[2]
        qk = R.multiply(q, k)
        a = R.add(qk, v)
        wot = R.permute_dims(wo, axes=[1, 0])
        out = R.matmul(a, wot)
        R.output(out)
    return out


def test_fused_qkv_is_resegmented_then_split_per_segment():
    v = _vars(qkv)
    with pytest.raises(Resegment) as reseg:  # one segment of 24 cut into 3 pieces of 8
        propagate(qkv, 2, {v["wqkv"]: (0, 24)}, _params(qkv), set())
    assert reseg.value.segments == 3
    with pytest.raises(Request) as request:  # each piece split: wo's input features follow
        propagate(qkv, 2, {v["wqkv"]: (0, 8)}, _params(qkv), set())
    assert (request.value.param.name, request.value.dim, request.value.size) == ("wo", 1, 8)
    result = propagate(qkv, 2, {v["wqkv"]: (0, 8), v["wo"]: (1, 8)}, _params(qkv), set())
    layouts = {var.name: hi for var, hi in result.layouts.items()}
    assert layouts == {"wqkv": 64, "wt": 8, "fused": 8, "parts": (8, 8, 8), "q": 8, "k": 8,
                       "v": 8, "qk": 8, "a": 8, "wo": 8, "wot": 48}
    assert {var.name for var in result.partials} == {"out"}
    # rank r holds rows [4r, 4r + 4) of each of q, k and v: 12 of the 24 fused rows
    assert local_shape((24, 8), 64, 2) == (12, 8)
    assert dim_of((24, 8), 64, 2) == (0, 8)


# ---- vocabulary-parallel embedding ------------------------------------------------------
def _embedding(axis_of_split):
    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType((3,), "int64"))
    table = relax.Var("table", relax.TensorType((10, 4), "float32"))
    with bb.function("forward", [ids, table]):
        with bb.dataflow():
            e = bb.emit(relax.op.take(table, ids, axis=0), "e")
            out = bb.emit_output(relax.op.nn.relu(e), "out")
        bb.emit_func_output(out)
    func = bb.get()["forward"]
    placement = (0, 10) if axis_of_split == 0 else (1, 4)
    return func, {func.params[1]: placement}


def test_embedding_split_along_the_vocabulary_is_a_partial_lookup():
    func, placements = _embedding(0)
    result = propagate(func, 2, placements, {func.params[1]}, set())
    assert {var.name: hi for var, hi in result.layouts.items()} == {"table": 40}
    assert {var.name for var in result.partials} == {"e"}
    assert {var.name for var in result.vocab_takes} == {"e"}


def test_embedding_split_along_its_features_is_unsplittable():
    func, placements = _embedding(1)
    with pytest.raises(Unsplittable, match="e: take from a table split along another axis"):
        propagate(func, 2, placements, {func.params[1]}, set())


# ---- outputs and the ops that stop the split ---------------------------------------------
def _column(tail):
    """x @ w^T with w [16, 8] split by rows (h: [4, 16] split by columns), then ``tail``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((16, 8), "float32"))
    with bb.function("forward", [x, w]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(w, axes=[1, 0]), "wt")
            h = bb.emit(relax.op.matmul(x, wt), "h")
            out = bb.emit_output(tail(h), "out")
        bb.emit_func_output(out)
    func = bb.get()["forward"]
    return func, {func.params[1]: (0, 16)}, {func.params[1]}


def test_split_output_only_for_a_vocabulary_parallel_loss():
    func, placements, params = _column(lambda h: relax.op.nn.relu(h))
    with pytest.raises(Unsplittable, match=r"out: a split value is an output of the forward "
                                           r"\(a vocabulary-parallel loss needs cross_entropy\)"):
        propagate(func, 2, placements, params, set())
    result = propagate(func, 2, placements, params, set(), split_output=True)
    assert result.output_split is True
    assert {var.name: hi for var, hi in result.layouts.items()} == {
        "w": 128, "wt": 16, "h": 16, "out": 16}


@pytest.mark.parametrize("tp, tail, why", [
    (2, lambda h: relax.op.nn.softmax(h, axis=-1), "out works along the split dimension 1"),
    (2, lambda h: relax.op.sum(h, axis=[1]), "reduces over the split dimension 1"),
    (2, lambda h: relax.op.cumsum(h, axis=0), "relax.cumsum is not known to the "
                                              "tensor-parallel pass"),
    (4, lambda h: relax.op.reshape(h, (4, 2, 8)), r"reshape to \[4, 2, 8\] cuts the split "
                                                  r"dimension \(its parts do not divide by 4\)"),
    (2, lambda h: relax.op.strided_slice(h, axes=[1], begin=[0], end=[8]),
     "out works along the split dimension 1"),
    (2, lambda h: relax.op.concat([h, relax.const(np.zeros((4, 16), "float32"))], axis=0),
     "concatenates split and replicated values"),
])
def test_unsplittable(tp, tail, why):
    func, placements, params = _column(tail)
    with pytest.raises(Unsplittable, match=why) as stop:
        propagate(func, tp, placements, params, set())
    assert stop.value.var.name == "out"


@pytest.mark.parametrize("tail, back, t_hi", [
    # [1, 16]: a reduction over the rows keeps the split columns
    (lambda h: relax.op.sum(h, axis=[0], keepdims=True), None, 16),
    (lambda h: relax.op.nn.softmax(h, axis=0), None, 16),
    # dim 1 of [4, 4, 4], 4 elements per segment
    (lambda h: relax.op.reshape(h, (4, 4, 4)), lambda t: relax.op.reshape(t, (4, 16)), 16),
    (lambda h: relax.op.strided_slice(h, axes=[0], begin=[0], end=[2]), None, 16),  # [2, 16]
    (lambda h: relax.op.concat([h, h], axis=0), None, 16),  # [8, 16]
    # [16, 4]: the split rows, 16 * 4
    (lambda h: relax.op.permute_dims(h, axes=[1, 0]),
     lambda t: relax.op.permute_dims(t, axes=[1, 0]), 64),
])
def test_ops_away_from_the_split_dimension_keep_it(tail, back, t_hi):
    """t = tail(h), out = back(t) split along its last dimension whole (hi = its size): a
    split logits output, accepted for a vocabulary-parallel loss."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((16, 8), "float32"))
    with bb.function("forward", [x, w]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(w, axes=[1, 0]), "wt")
            h = bb.emit(relax.op.matmul(x, wt), "h")
            t = bb.emit(tail(h), "t")
            out = bb.emit_output(relax.op.nn.relu(t) if back is None else back(t), "out")
        bb.emit_func_output(out)
    func = bb.get()["forward"]
    result = propagate(func, 2, {w: (0, 16)}, {w}, set(), split_output=True)
    layouts = {var.name: hi for var, hi in result.layouts.items()}
    assert (layouts["h"], layouts["t"], layouts["out"]) == (16, t_hi, 16)
    assert result.output_split is True
