"""WidenAtUse (passes/widen_at_use.py): a 16-bit gradient widened for the optimizer is read
through a cast fused into each reader; no float32 copy is kept between them."""
import numpy as np
import tvm
from tvm import relax
from tvm.relax import op

from raf_dist.compiler import build
from raf_dist.passes.widen_at_use import WidenAtUse

SHAPE = (48, 40)


def _update(reader_is_packed=False):
    """main(g16, m, p): the guard's sum of g, Adam-like moments m*0.9 + g*0.1 and g*g, and
    p - g; with ``reader_is_packed`` the widened g is also read by a packed call."""
    g16 = relax.Var("g16", relax.TensorType(SHAPE, "bfloat16"))
    m = relax.Var("m", relax.TensorType(SHAPE, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [g16, m]):
        with bb.dataflow():
            g = bb.emit(op.astype(g16, "float32"))
            total = bb.emit(op.sum(bb.emit(op.reshape(g, (SHAPE[0] * SHAPE[1],)))))
            moment = bb.emit(op.add(op.multiply(m, relax.const(0.9, "float32")),
                                    op.multiply(g, relax.const(0.1, "float32"))))
            square = bb.emit(op.multiply(g, g))
            outs = [total, moment, square]
            if reader_is_packed:
                outs.append(bb.emit(relax.call_dps_packed(
                    "raf_dist.blas.matmul", [g, g, 0, 1],
                    relax.TensorType((SHAPE[0], SHAPE[0]), "float32"))))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _casts(mod):
    return [b for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.astype"]


def test_each_reader_widens_for_itself_same_values(tmp_path):
    """Before: one astype read by a reshape (then sum), a multiply and multiply(g, g).
    Expected: three astypes of g16, one before each reader (one for g * g), no float32
    value read by two bindings; the outputs are the same bits (widening is exact)."""
    import ml_dtypes

    before = _update()
    after = WidenAtUse()(before)
    casts = _casts(after)
    assert len(casts) == 3 and all(c.value.args[0].name == "g16" for c in casts)
    readers = {}
    for block in after["main"].body.blocks:
        for b in block.bindings:
            for v in relax.analysis.free_vars(b.value):
                readers.setdefault(v, []).append(b.var)
    assert all(len(readers[c.var]) == 1 for c in casts)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(SHAPE).astype(ml_dtypes.bfloat16),
            rng.standard_normal(SHAPE).astype("float32")]

    def run(mod, name):
        vm = relax.VirtualMachine(build.compile_step(mod, cache_dir=tmp_path / name).executable,
                                  tvm.cpu())
        return [t.numpy() for t in vm["main"](*(tvm.runtime.tensor(a) for a in args))]

    for got, ref in zip(run(after, "after"), run(before, "before")):
        np.testing.assert_array_equal(got, ref)


def test_a_widening_a_packed_call_reads_is_kept():
    """A BLAS call (or a collective) needs the float32 buffer: nothing changes."""
    mod = _update(reader_is_packed=True)
    after = WidenAtUse()(mod)
    assert len(_casts(after)) == 1
    tvm.ir.assert_structural_equal(after, relax.transform.CanonicalizeBindings()(mod))
