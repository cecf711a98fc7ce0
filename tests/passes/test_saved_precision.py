"""save_low_precision (raf_dist.passes.saved_precision): the backward of a 16-bit step reads
the forward's 16-bit copies. A widened value is read again from its 16-bit source (exact);
a float32 value the forward narrows (softmax's probabilities, through a same-shape
broadcast) is read from the narrowed copy; the forward itself is untouched."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from raf_dist.passes.saved_precision import save_low_precision

N_FORWARD = 6


@R.function
def adjoint_like(x: R.Tensor((4, 8), "bfloat16"), w: R.Tensor((8, 8), "bfloat16")):
    with R.dataflow():
        # the forward: a bf16 residual widened for a norm, a float32 softmax narrowed
        a = R.add(x, x)
        a32 = R.astype(a, "float32")
        s = R.nn.softmax(a32, axis=-1)
        sb = R.broadcast_to(s, R.shape([4, 8]))
        s16 = R.astype(sb, "bfloat16")
        y = R.matmul(s16, w)
        # the backward reads a32 and s
        g1 = R.multiply(a32, a32)
        g2 = R.multiply(s, g1)
        R.output(y, g1, g2)
    return (y, g1, g2)


def _bindings(func):
    return list(func.body.blocks[0].bindings)


def _free_names(binding):
    return {v.name for v in relax.analysis.free_vars(binding.value)}


def test_the_backward_reads_the_16_bit_copies_and_the_forward_is_untouched():
    after = save_low_precision(adjoint_like, N_FORWARD)
    before_bindings, bindings = _bindings(adjoint_like), _bindings(after)
    assert [b.var.name for b in bindings[:N_FORWARD]] == [
        b.var.name for b in before_bindings[:N_FORWARD]]
    by_name = {b.var.name: b for b in bindings}
    backward = bindings[N_FORWARD:]
    read = set().union(*(_free_names(b) for b in backward))
    assert not read & {"a32", "s"}, read  # the float32 values die in the forward
    widened = by_name["a32_from_low"].value  # exact: the bf16 source widened again
    assert widened.op.name == "relax.astype" and widened.args[0].name == "a"
    narrowed = by_name["s_from_low"].value  # the narrowed probabilities widened
    assert narrowed.op.name == "relax.astype" and narrowed.args[0].name == "s16"
    assert str(by_name["s_from_low"].var.ty.dtype) == "float32"


def test_a_float32_step_is_left_alone():
    @R.function
    def fp32(x: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            s = R.nn.softmax(x, axis=-1)
            g = R.multiply(s, s)
            R.output(g)
        return g

    assert save_low_precision(fp32, 1).same_as(fp32)


def test_the_values_match_up_to_the_narrowing():
    """Both run: y and g1 (read through the exact widening) equal bit for bit, g2 (through
    the bf16 probabilities) within bf16's rounding of them."""
    import ml_dtypes  # numpy's bfloat16

    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for shape in ((4, 8), (8, 8)))

    def run(func):
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
        return [o.numpy().astype("float32") for o in out]

    before, after = run(adjoint_like), run(save_low_precision(adjoint_like, N_FORWARD))
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert 0 < np.abs(after[2] - before[2]).max() <= 2 ** -8 * np.abs(before[2]).max()


@R.function
def reshaped_widening(x: R.Tensor((4, 8), "bfloat16")):
    with R.dataflow():
        # the forward: gelu_new's power reads its bf16 input widened, then reshaped
        a = R.add(x, x)
        a32 = R.astype(a, "float32")
        r = R.reshape(a32, R.shape([2, 16]))
        p = R.power(r, R.const(3.0, "float32"))
        # the backward reads the reshape
        g = R.multiply(r, p)
        R.output(p, g)
    return (p, g)


def test_a_reshape_of_a_widened_value_is_read_from_the_16_bit_source():
    after = save_low_precision(reshaped_widening, 4)
    bindings = _bindings(after)
    backward = bindings[4:]
    read = set().union(*(_free_names(b) for b in backward))
    assert "r" not in read and "a32" not in read, read  # the float32 values die in the forward
    by_name = {b.var.name: b for b in bindings}
    flat = by_name["r_from_low_flat"].value  # x widened again (exact), then reshaped
    assert flat.op.name == "relax.astype" and flat.args[0].name == "a"
    assert by_name["r_from_low"].value.op.name == "relax.reshape"
