"""LowerAllReduce: each ``y = R.ccl.allreduce(x, op)`` (synchronized batch norm's statistics and
their backward) becomes ``y = alloc_tensor(shape of x)`` plus a blocking, impure
``R.call_packed("raf_dist.ccl.allreduce", x, op, group, y)``, the dataflow block split around
it. Pinned here (Before / Expected): the op type taken from the call (sum, avg), the group from
the pass's argument, functions without an allreduce left as they were (still pure), an
allreduce in an impure block, and ``lower_allreduce_op`` on another one-tensor op with an
explicit op type (what LowerTensorParallel uses). No MPI, no compilation."""
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.passes.lower_allreduce import LowerAllReduce, lower_allreduce_op
from raf_dist.passes.tp_ops import tp_reduce


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 3), "float32")):
        with R.dataflow():
            s = R.sum(x, axis=[0], keepdims=True)
            r = R.ccl.allreduce(s, "sum")
            c = R.subtract(x, r)
            q = R.multiply(c, c)
            v = R.ccl.allreduce(q, "avg")
            R.output(v)
        return v

    @R.function
    def untouched(x: R.Tensor((2, 3), "float32")):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function(pure=False)
    def main(x: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3), "float32"):
        with R.dataflow():
            s = R.sum(x, axis=[0], keepdims=True)
            # the result buffer has the input's shape; the collective writes it
            r = R.builtin.alloc_tensor(R.shape([1, 3]), R.dtype("float32"), 0, R.str("global"))
            R.output(s, r)
        R.call_packed("raf_dist.ccl.allreduce", s, R.str("sum"), 7, r, ty_args=(R.Tuple,))
        with R.dataflow():
            c = R.subtract(x, r)
            q = R.multiply(c, c)
            v = R.builtin.alloc_tensor(R.shape([2, 3]), R.dtype("float32"), 0, R.str("global"))
            R.output(q, v)
        R.call_packed("raf_dist.ccl.allreduce", q, R.str("avg"), 7, v, ty_args=(R.Tuple,))
        return v

    @R.function
    def untouched(x: R.Tensor((2, 3), "float32")):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y


def test_each_allreduce_becomes_a_blocking_runtime_call():
    tvm.ir.assert_structural_equal(LowerAllReduce(group=7)(Before), Expected)


def test_default_group_is_zero():
    func = LowerAllReduce()(Before)["main"]
    calls = [b.value for block in func.body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and isinstance(b.value.op, relax.ExternFunc)]
    assert [(c.op.global_symbol, str(c.args[1].value), int(c.args[2].value)) for c in calls] == [
        ("raf_dist.ccl.allreduce", "sum", 0), ("raf_dist.ccl.allreduce", "avg", 0)]


def test_module_without_allreduce_is_unchanged():
    mod = tvm.IRModule({"untouched": Before["untouched"]})
    tvm.ir.assert_structural_equal(LowerAllReduce(3)(mod), mod)


def test_allreduce_in_an_impure_block():
    @I.ir_module
    class Impure:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float16")):
            y = R.ccl.allreduce(x, "sum")
            z = R.add(y, y)
            return z

    @I.ir_module
    class ExpectedImpure:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float16")) -> R.Tensor((4,), "float16"):
            y = R.builtin.alloc_tensor(R.shape([4]), R.dtype("float16"), 0, R.str("global"))
            R.call_packed("raf_dist.ccl.allreduce", x, R.str("sum"), 2, y, ty_args=(R.Tuple,))
            z = R.add(y, y)
            return z

    tvm.ir.assert_structural_equal(LowerAllReduce(2)(Impure), ExpectedImpure)


def test_lower_allreduce_op_with_another_op_and_an_explicit_op_type():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            g = bb.emit(tp_reduce(x), name_hint="g")  # no attributes: "sum" unless told
            out = bb.emit_output(relax.op.add(g, x), name_hint="out")
        bb.emit_func_output(out)
    func = bb.get()["main"]
    op = tvm.ir.Op.get("raf_dist.tp_reduce")

    @I.ir_module
    class ExpectedMax:
        @R.function(pure=False)
        def main(x: R.Tensor((3,), "float32")) -> R.Tensor((3,), "float32"):
            with R.dataflow():
                g = R.builtin.alloc_tensor(R.shape([3]), R.dtype("float32"), 0, R.str("global"))
                R.output(g)
            R.call_packed("raf_dist.ccl.allreduce", x, R.str("max"), 4, g, ty_args=(R.Tuple,))
            with R.dataflow():
                out = R.add(g, x)
                R.output(out)
            return out

    lowered = relax.transform.Normalize()(tvm.IRModule(
        {"main": lower_allreduce_op(func, 4, op, "max")}))
    tvm.ir.assert_structural_equal(lowered, ExpectedMax)
    summed = lower_allreduce_op(func, 4, op)
    call = summed.body.blocks[1].bindings[0].value
    assert str(call.args[1].value) == "sum"
    # R.ccl.allreduce calls only (the default op): the tp_reduce is not touched
    assert lower_allreduce_op(func, 4).same_as(func)
