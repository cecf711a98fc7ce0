"""What the distribution passes share (passes/bucketing.py): which gradients travel together
(``gradient_buckets`` / ``marker_buckets`` over a step's gradient markers, in backward order,
closing a bucket once it holds >= bucket_bytes), and how a new body is put together: Segments
alternates dataflow and impure binding lists, ``collective`` is an impure packed call (a
handle for a ``*_start``, nothing otherwise), ``assemble`` turns the segments into blocks and
makes every dataflow variable used outside its block an ordinary variable (Before / Expected).
assign_buckets' and bucket_layout's tables live in test_data_parallel.py. No MPI."""
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes.bucketing import (Segments, assemble, assign_buckets, collective,
                                       gradient_buckets, marker_buckets)
from raf_dist.passes.gradient_markers import find_markers


@I.ir_module
class Step:
    @R.function
    def train_step(x: R.Tensor((4,), "float32"), w1: R.Tensor((4,), "float32"),
                   w2: R.Tensor((2, 3), "float16"), w3: R.Tensor((2,), "float32")):
        with R.dataflow():
            loss = R.sum(R.multiply(x, w1))
            # backward produces w3's gradient (8 bytes), then w2's (12), then w1's (16)
            g3 = R.multiply(w3, R.const(2.0, "float32"))
            m3 = R.call_pure_packed("raf_dist.mark_gradient", g3, R.prim_value(2),
                                    ty_args=R.Tensor((2,), "float32"))
            g2 = R.multiply(w2, R.const(2.0, "float16"))
            m2 = R.call_pure_packed("raf_dist.mark_gradient", g2, R.prim_value(1),
                                    ty_args=R.Tensor((2, 3), "float16"))
            g1 = R.multiply(x, R.const(3.0, "float32"))
            m1 = R.call_pure_packed("raf_dist.mark_gradient", g1, R.prim_value(0),
                                    ty_args=R.Tensor((4,), "float32"))
            new_w1 = R.subtract(w1, m1)
            new_w2 = R.subtract(w2, m2)
            new_w3 = R.subtract(w3, m3)
            out = (loss, new_w1, new_w2, new_w3)
            R.output(out)
        return out


@pytest.mark.parametrize("bucket_bytes, expected", [
    (1, [[2], [1], [0]]),  # every gradient closes its bucket
    (8, [[2], [1], [0]]),  # exactly bucket_bytes closes it
    (9, [[2, 1], [0]]),  # 8 < 9, 8 + 12 >= 9
    (20, [[2, 1], [0]]),  # 8 + 12 = 20
    (21, [[2, 1, 0]]),  # 20 < 21: w1 joins; the last bucket may stay under bucket_bytes
    (1 << 20, [[2, 1, 0]]),
])
def test_gradient_buckets_in_backward_order(bucket_bytes, expected):
    assert gradient_buckets(Step, bucket_bytes) == expected


def test_gradient_buckets_of_another_function():
    mod = tvm.IRModule({"stage0_step": Step["train_step"]})
    assert gradient_buckets(mod, 9, func_name="stage0_step") == [[2, 1], [0]]


def test_marker_buckets_uses_each_markers_bytes():
    markers = find_markers(Step["train_step"].body.blocks[0])
    assert [m.nbytes for m in markers] == [8, 12, 16]
    assert marker_buckets(markers, 8) == [[2], [1], [0]]
    assert marker_buckets(markers, 12) == [[2, 1], [0]]
    assert marker_buckets(markers[1:], 28) == [[1, 0]]
    assert marker_buckets([], 16) == []


def test_a_bucket_holds_one_optimizer_group():
    """Parameter groups (raf_dist.update_groups): a bucket closes where backward moves on to
    another group's gradient (ZeRO runs one update chain per bucket), also in the step's
    attribute as gradient_buckets reads it."""
    markers = find_markers(Step["train_step"].body.blocks[0])  # backward: params 2, 1, 0
    assert marker_buckets(markers, 100, groups=[0, 0, 0]) == [[2, 1, 0]]
    assert marker_buckets(markers, 100, groups=[1, 0, 0]) == [[2, 1], [0]]
    assert marker_buckets(markers, 100, groups=[0, 1, 0]) == [[2], [1], [0]]
    assert marker_buckets(markers, 100, groups=[1, 1, 0]) == [[2], [1, 0]]
    assert marker_buckets(markers, 12, groups=[1, 1, 0]) == [[2], [1], [0]]  # bytes too
    grouped = Step["train_step"].with_attr("raf_dist.update_groups", [1, 0, 0])
    assert gradient_buckets(tvm.IRModule({"train_step": grouped}), 100) == [[2, 1], [0]]


def test_assign_buckets_keeps_an_oversized_item_alone():
    assert assign_buckets([4, 100, 4], 8) == [[0, 1], [2]]
    assert assign_buckets([100, 4, 4], 8) == [[0], [1, 2]]


def test_collective_is_impure_with_a_handle_only_for_start():
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    blocking = collective("raf_dist.ccl.allreduce", x, tvm.ir.StringImm("sum"),
                          relax.prim_value(0), x)
    start = collective("raf_dist.ccl.allreduce_start", x, tvm.ir.StringImm("sum"),
                       relax.prim_value(0), x)
    assert blocking.op.global_symbol == "raf_dist.ccl.allreduce"
    assert start.op.global_symbol == "raf_dist.ccl.allreduce_start"
    assert len(blocking.args) == len(start.args) == 4
    tvm.ir.assert_structural_equal(list(blocking.ty_args), [relax.TupleType([])])
    tvm.ir.assert_structural_equal(list(start.ty_args), [tvm.ir.PrimType("int64")])


def test_segments_alternate_and_bind_the_right_kind_of_variable():
    seg = Segments()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    a = seg.bind("a", relax.op.add(x, x))
    b = seg.bind("b", relax.op.multiply(a, a))
    c = seg.bind("c", collective("raf_dist.ccl.allreduce", b, tvm.ir.StringImm("sum"),
                                 relax.prim_value(0), b), dataflow=False)
    d = seg.bind("d", relax.op.add(b, b))
    assert [(kind, [bd.var.name for bd in bindings]) for kind, bindings in seg.segments] == [
        ("dataflow", ["a", "b"]), ("impure", ["c"]), ("dataflow", ["d"])]
    assert [type(v).__name__ for v in (a, b, c, d)] == [
        "DataflowVar", "DataflowVar", "Var", "DataflowVar"]
    tvm.ir.assert_structural_equal(a.ty, relax.TensorType((4,), "float32"))  # normalized


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4,), "float32")):
        R.func_attr({"raf_dist.num_params": 1})
        with R.dataflow():
            a = R.multiply(x, R.const(2.0, "float32"))
            t = R.add(a, R.const(1.0, "float32"))
            b = R.add(t, a)
            R.output(b)
        return b


@I.ir_module
class Expected:
    @R.function(pure=False)
    def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
        R.func_attr({"raf_dist.num_params": 1})
        with R.dataflow():
            a = R.multiply(x, R.const(2.0, "float32"))  # read after the collective: a Var
            R.output(a)
        R.call_packed("raf_dist.ccl.allreduce", a, R.str("sum"), 0, a, ty_args=(R.Tuple,))
        with R.dataflow():
            t = R.add(a, R.const(1.0, "float32"))  # used in its own block only: stays local
            b = R.add(t, a)
            R.output(b)
        return b


def _split_around_allreduce(func):
    """Before's bindings with a blocking allreduce of ``a`` after the first one."""
    bindings = list(func.body.blocks[0].bindings)
    seg = Segments()
    seg.add(bindings[0])
    seg.bind("allreduce", collective("raf_dist.ccl.allreduce", bindings[0].var,
                                     tvm.ir.StringImm("sum"), relax.prim_value(0),
                                     bindings[0].var), dataflow=False)
    for binding in bindings[1:]:
        seg.add(binding)
    return seg


def test_assemble_makes_escaping_dataflow_vars_ordinary():
    func = Before["main"]
    seg = _split_around_allreduce(func)
    after = assemble(func, seg.segments, func.body.body)
    # the passes normalize what assemble returns (it leaves the body's type to Normalize)
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(tvm.IRModule({"main": after})),
                                   Expected)


def test_assemble_drops_empty_segments_and_takes_new_params_and_return_type():
    seg = Segments()  # starts with an empty dataflow segment
    y = relax.Var("y", relax.TensorType((2, 2), "float16"))
    seg.bind("r", collective("raf_dist.ccl.allreduce", y, tvm.ir.StringImm("avg"),
                             relax.prim_value(3), y), dataflow=False)
    after = assemble(Before["main"], seg.segments, y, params=[y], ret_ty=y.ty)

    @I.ir_module
    class ExpectedNoDataflow:
        @R.function(pure=False)
        def main(y: R.Tensor((2, 2), "float16")) -> R.Tensor((2, 2), "float16"):
            R.func_attr({"raf_dist.num_params": 1})  # the attributes are kept
            R.call_packed("raf_dist.ccl.allreduce", y, R.str("avg"), 3, y, ty_args=(R.Tuple,))
            return y

    tvm.ir.assert_structural_equal(relax.transform.Normalize()(tvm.IRModule({"main": after})),
                                   ExpectedNoDataflow)
