"""IR tier for mixed precision (passes/auto_cast.py): TVMScript Before / Expected, structural
equality. AutoCast on a forward (matmul low, layer_norm and softmax float32, elementwise
following its operands, a transposed weight cast under its transpose, one cast per value, the
output cast back); an op without a rule refused by name; AccumulateInFloat32 on 16-bit
products and reductions TVM would otherwise accumulate in 16 bits."""
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes.auto_cast import AccumulateInFloat32, auto_cast, rule_of


@R.function
def forward(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32"),
            b: R.Tensor((8,), "float32"), g: R.Tensor((8,), "float32")):
    with R.dataflow():
        wt = R.permute_dims(w, axes=[1, 0])
        h = R.matmul(x, wt, out_dtype="float32")  # the importer writes out_dtype
        h2 = R.add(h, b)
        a = R.nn.gelu(h2)
        n = R.nn.layer_norm(a, g, b, axes=[-1])
        y = R.matmul(n, wt, out_dtype="float32")
        s = R.nn.softmax(y)
        gv = R.add(s, h2)
        R.output(gv)
    return gv


@R.function
def expected(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32"),
             b: R.Tensor((8,), "float32"), g: R.Tensor((8,), "float32")):
    with R.dataflow():
        wt = R.permute_dims(w, axes=[1, 0])  # dead: DeadCodeElimination removes it later
        x16 = R.astype(x, "bfloat16")
        w16 = R.astype(w, "bfloat16")
        wt16 = R.permute_dims(w16, axes=[1, 0])  # still foldable into a transpose flag
        h = R.matmul(x16, wt16)
        b16 = R.astype(b, "bfloat16")
        h2 = R.add(h, b16)
        a = R.nn.gelu(h2)
        a32 = R.astype(a, "float32")
        n = R.nn.layer_norm(a32, g, b, axes=[-1])
        n16 = R.astype(n, "bfloat16")
        y = R.matmul(n16, wt16)  # the cached casts reused
        y32 = R.astype(y, "float32")
        s = R.nn.softmax(y32)
        s16 = R.astype(s, "bfloat16")
        out16 = R.add(s16, h2)
        out = R.astype(out16, "float32")
        gv = out
        R.output(gv)
    return gv


def test_forward_cast_by_rule():
    tvm.ir.assert_structural_equal(auto_cast(forward, "bfloat16"),
                                   expected.with_attr("global_symbol", "forward"))


@R.function
def stage(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32"),
          b: R.Tensor((8,), "float32")):
    with R.dataflow():
        h = R.matmul(x, w, out_dtype="float32")
        gv = R.add(h, b)
        R.output(gv)
    return gv


@R.function
def stage_expected(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32"),
                   b: R.Tensor((8,), "float32")):
    with R.dataflow():
        x16 = R.astype(x, "bfloat16")
        w16 = R.astype(w, "bfloat16")
        h = R.matmul(x16, w16)
        b16 = R.astype(b, "bfloat16")
        out16 = R.add(h, b16)
        out = R.astype(out16, "float32")
        output_low = R.astype(out, "bfloat16")  # the stage's result, sent in bfloat16
        gv = output_low
        R.output(gv)
    return gv


def test_pipeline_stage_output_in_the_low_dtype():
    """A pipeline stage before the last (runtime/pipeline_executor.py): its activation leaves in
    bfloat16, half the bytes of each message (its gradient travels back in the same dtype;
    the next stage's float32 input is the message widened)."""
    tvm.ir.assert_structural_equal(auto_cast(stage, "bfloat16", low_output=True),
                                   stage_expected.with_attr("global_symbol", "stage"))


def test_float16_same_rules():
    out = auto_cast(forward, "float16").script()
    assert out.count('R.astype(w, dtype="float16")') == 1 and "bfloat16" not in out


def test_embedding_exchange_carries_float32_on_every_rank():
    """The embedding tables' all-to-all (passes/embedding_parallel.py) is different IR on
    each side: a holder sends pooled bags (a matmul: low precision under AutoCast), another
    rank an empty block of float32 rows. It carries float32 whatever its input, so both
    sides agree (following the input, MPI failed on the mismatch)."""
    from tvm import relax
    from raf_dist.ir.ops import ep_exchange

    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("forward", [x, w]):
        with bb.dataflow():
            pooled = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(ep_exchange(pooled, [4, 0], [4, 0]))
        bb.emit_func_output(out)
    func = auto_cast(bb.get()["forward"], "bfloat16")
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    sent = [v.args[0] for v in bindings.values()
            if isinstance(v, relax.Call) and "ep_exchange" in str(v.op)]
    assert len(sent) == 1 and sent[0].ty.dtype == "float32", func.script()
    assert 'dtype="bfloat16") = R.matmul(' in func.script()  # the pooling still in bf16


def test_op_without_rule_is_refused_by_name():
    @R.function
    def f(x: R.Tensor((1, 1, 4, 4), "float32"), w: R.Tensor((4, 4), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            gv = R.image.grid_sample(y, R.zeros((1, 4, 4, 2), "float32"))
            R.output(gv)
        return gv

    with pytest.raises(NotImplementedError, match=r"relax.image.grid_sample has no cast rule"):
        auto_cast(f, "bfloat16")
    assert rule_of("relax.image.resize2d") == "follow"
    assert rule_of("raf_dist.tp_reduce") == "follow"  # raf_dist's own ops follow their input


@I.ir_module
class Products:
    @R.function
    def main(a: R.Tensor((4, 8), "bfloat16"), b: R.Tensor((8, 3), "bfloat16"),
             d: R.Tensor((1, 2, 5, 5), "bfloat16"), k: R.Tensor((2, 2, 3, 3), "bfloat16")):
        with R.dataflow():
            m = R.matmul(a, b)
            c = R.nn.conv2d(d, k)
            s = R.collapse_sum_to(m, (3,))
            f = R.matmul(R.astype(a, "float32"), R.astype(b, "float32"))  # left alone
            gv = (m, c, s, f)
            R.output(gv)
        return gv


@I.ir_module
class ProductsExpected:
    @R.function
    def main(a: R.Tensor((4, 8), "bfloat16"), b: R.Tensor((8, 3), "bfloat16"),
             d: R.Tensor((1, 2, 5, 5), "bfloat16"), k: R.Tensor((2, 2, 3, 3), "bfloat16")):
        with R.dataflow():
            m32 = R.matmul(a, b, out_dtype="float32")
            m = R.astype(m32, "bfloat16")
            c32 = R.nn.conv2d(d, k, out_dtype="float32")
            c = R.astype(c32, "bfloat16")
            wide = R.astype(m, "float32")
            s32 = R.collapse_sum_to(wide, (3,))
            s = R.astype(s32, "bfloat16")
            f = R.matmul(R.astype(a, "float32"), R.astype(b, "float32"))
            gv = (m, c, s, f)
            R.output(gv)
        return gv


def test_sums_of_products_accumulate_in_float32():
    tvm.ir.assert_structural_equal(AccumulateInFloat32()(Products), ProductsExpected)
