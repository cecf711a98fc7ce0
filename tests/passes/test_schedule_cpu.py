"""IR tier for ScheduleCPU: the loops it produces (kinds and extents), unchanged results, and
fallbacks that are logged (or raise in strict mode, which the suite runs in)."""
import logging

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.compiler import ScheduleCPU, compile_step
from raf_dist.compiler.schedule import ScheduleFallbackError


def _lowered(mod):
    with tvm.target.Target("llvm"):
        return tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                         relax.transform.AnnotateTIROpPattern(),
                                         relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)


def _loop_kinds(func):
    kinds = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda loop: kinds.append(
        (loop.kind, int(loop.extent))))])
    return kinds


@I.ir_module
class Elementwise:
    @R.function
    def main(x: R.Tensor((256, 512), "float32"), y: R.Tensor((256, 512), "float32")):
        with R.dataflow():
            z = R.nn.relu(R.add(R.multiply(x, y), x))
            R.output(z)
        return z


def test_elementwise_is_fused_parallel_and_vectorised():
    scheduled = ScheduleCPU()(_lowered(Elementwise))
    prims = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert len(prims) == 1
    kinds = _loop_kinds(prims[0])
    # one fused loop split into 256*512/8 parallel iterations of 8 vector lanes
    assert sorted(kinds, key=lambda k: k[1]) == [(tirx.ForKind.VECTORIZED, 8),
                                                 (tirx.ForKind.PARALLEL, 256 * 512 // 8)]


def test_rows_not_a_multiple_of_the_vector_run_as_parallel_rows_not_gathers():
    """An elementwise kernel over a 3x3 kernel's weight (the innermost axis 3): vector lanes
    would cross rows and TVM would gather each lane through divisions (an Adam update on a
    512x512x3x3 weight: 3.3 ms against 0.41 ms on the same elements as one axis). The outer
    axes run in parallel, the rows stay plain loops, and the result is unchanged."""
    @I.ir_module
    class Weight:
        @R.function
        def main(x: R.Tensor((64, 32, 3, 3), "float32"), y: R.Tensor((64, 32, 3, 3), "float32")):
            with R.dataflow():
                z = R.add(R.multiply(x, R.const(0.9, "float32")), y)
                R.output(z)
            return z

    scheduled = ScheduleCPU()(_lowered(Weight))
    prim = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)][0]
    kinds = _loop_kinds(prim)
    assert (tirx.ForKind.PARALLEL, 64 * 32 * 3) in kinds
    assert all(kind != tirx.ForKind.VECTORIZED for kind, _ in kinds)
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((64, 32, 3, 3)).astype("float32") for _ in range(2))
    step = compile_step(Weight, cache_dir=None)
    out = relax.VirtualMachine(step.executable, tvm.cpu())["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(y)).numpy()
    # within an ulp, not bitwise: on a CPU with FMA, LLVM fuses the multiply and the add
    np.testing.assert_allclose(out, x * np.float32(0.9) + y, rtol=2.5e-7, atol=1e-7)


def test_compile_step_llvm_is_this_machines_cpu():
    """``compile_step(..., target="llvm")`` builds for the host CPU like the Trainer
    (device.host_target): a bare "llvm" is baseline x86-64 (SSE2, no FMA, floor a libm call),
    which made the kernel measurements taken through compile_step 5x slower than the step's."""
    from raf_dist.compiler.build import make_target
    from raf_dist.device import host_target

    assert str(make_target("llvm")) == str(tvm.target.Target(host_target()))


def test_small_work_stays_serial():
    @I.ir_module
    class Small:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                z = R.exp(x)
                R.output(z)
            return z

    prims = [f for _, f in ScheduleCPU()(_lowered(Small)).functions_items()
             if isinstance(f, tirx.PrimFunc)]
    assert all(kind != tirx.ForKind.PARALLEL for kind, _ in _loop_kinds(prims[0]))


def test_reduction_parallel_over_rows_and_same_result():
    @I.ir_module
    class RowSum:
        @R.function
        def main(x: R.Tensor((512, 64), "float32")):
            with R.dataflow():
                z = R.sum(R.exp(x), axis=[1])
                R.output(z)
            return z

    scheduled = ScheduleCPU()(_lowered(RowSum))
    prims = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert any(kind == tirx.ForKind.PARALLEL and extent == 512
               for f in prims for kind, extent in _loop_kinds(f))
    x = np.random.default_rng(0).standard_normal((512, 64)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), np.exp(x).sum(1),
                               rtol=1e-5)


def _vectorised_blocks(func):
    """Names of the blocks inside a vectorised loop."""
    names = set()

    def visit(loop):
        if loop.kind == tirx.ForKind.VECTORIZED:
            tvm_ffi.structural_walk(loop.body, [(tvm.s_tir.SBlock, lambda b: names.add(
                b.name_hint))])

    tvm_ffi.structural_walk(func.body, [(tirx.For, visit)])
    return names


def test_row_reduction_accumulates_in_vector_lanes():
    """A sum along a contiguous row: 8 partial sums per row in vector lanes (rfactor), then the
    8 added; a scalar accumulation LLVM may not vectorise (it would reassociate float adds)
    was 4-10x slower (GPT-2's loss-gradient row sum 0.86 -> 0.11 ms)."""
    @I.ir_module
    class RowSum:
        @R.function
        def main(x: R.Tensor((1024, 512), "float32")):
            with R.dataflow():
                z = R.sum(x, axis=[1])
                R.output(z)
            return z

    scheduled = ScheduleCPU()(_lowered(RowSum))
    (prim,) = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    kinds = _loop_kinds(prim)
    assert (tirx.ForKind.PARALLEL, 1024) in kinds
    assert (tirx.ForKind.SERIAL, 512 // 8) in kinds  # the walk along the row, 8 at a time
    assert any(name.endswith("_rf_update") for name in _vectorised_blocks(prim))
    x = np.random.default_rng(4).standard_normal((1024, 512)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(),
                               x.astype("float64").sum(1), rtol=1e-4, atol=1e-4)


def test_layer_norm_runs_in_one_parallel_loop_over_rows():
    """Layer norm (mean, variance, normalisation) row-fused: every block computed inside one
    parallel loop over the 512 rows, its two reductions in vector lanes, the normalisation
    vectorised (GPT's layer norm 0.19 -> 0.06 ms; three parallel loops before)."""
    @I.ir_module
    class LayerNorm:
        @R.function
        def main(x: R.Tensor((32, 16, 128), "float32"), gamma: R.Tensor((128,), "float32"),
                 beta: R.Tensor((128,), "float32")):
            with R.dataflow():
                z = R.nn.layer_norm(x, gamma, beta, axes=[-1])
                R.output(z)
            return z

    scheduled = ScheduleCPU()(_lowered(LayerNorm))
    (prim,) = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    parallel = []
    tvm_ffi.structural_walk(prim.body, [(tirx.For, lambda loop: parallel.append(loop)
                                         if loop.kind == tirx.ForKind.PARALLEL else None)])
    assert [int(loop.extent) for loop in parallel] == [32 * 16]
    inside, everywhere = set(), set()
    tvm_ffi.structural_walk(parallel[0].body, [(tvm.s_tir.SBlock, lambda b: inside.add(
        b.name_hint))])
    tvm_ffi.structural_walk(prim.body, [(tvm.s_tir.SBlock, lambda b: everywhere.add(
        b.name_hint))])
    assert everywhere - {"root"} == inside
    vectorised = _vectorised_blocks(prim)
    assert sum(name.endswith("_rf_update") for name in vectorised) == 2  # mean and variance
    assert "T_layer_norm" in vectorised
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((32, 16, 128)) * 3 + 1).astype("float32")
    gamma, beta = (rng.standard_normal(128).astype("float32") for _ in range(2))
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    out = vm["main"](*(tvm.runtime.tensor(a) for a in (x, gamma, beta))).numpy()
    x64 = x.astype("float64")
    ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, ref * gamma + beta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["column_mean", "rows_of_65"])
def test_kernels_that_are_not_row_wise_are_scheduled_block_by_block(case):
    """Row fusion is refused when it would cost work or lanes: a column mean the output
    subtracts from every row would be recomputed per row (the work check), and rows of 65
    (ViT's tokens) measured slower fused than block by block (ViT's softmax 0.72 against 0.61
    ms). Each block is then scheduled on its own (column bands; parallel rows) and the results
    are unchanged."""
    if case == "column_mean":
        @I.ir_module
        class CentreColumns:
            @R.function
            def main(x: R.Tensor((256, 64), "float32")):
                with R.dataflow():
                    z = R.subtract(x, R.mean(x, axis=[0], keepdims=True))
                    R.output(z)
                return z
        mod, shape = CentreColumns, (256, 64)

        def reference(x):
            return x - x.mean(0, keepdims=True)
    else:
        @I.ir_module
        class Softmax65:
            @R.function
            def main(x: R.Tensor((512, 65), "float32")):
                with R.dataflow():
                    z = R.nn.softmax(x, axis=-1)
                    R.output(z)
                return z
        mod, shape = Softmax65, (512, 65)

        def reference(x):
            e = np.exp(x - x.max(-1, keepdims=True))
            return e / e.sum(-1, keepdims=True)

    scheduled = ScheduleCPU()(_lowered(mod))
    (prim,) = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    kinds = _loop_kinds(prim)
    assert [kind for kind, _ in kinds].count(tirx.ForKind.PARALLEL) >= 2  # one per block
    if case == "column_mean":
        assert (tirx.ForKind.PARALLEL, 64 // 8) in kinds  # the column bands
    else:  # each block parallel over the rows, a row a plain loop (no lanes across rows)
        assert kinds.count((tirx.ForKind.PARALLEL, 512)) >= 2
    x = np.random.default_rng(6).standard_normal(shape).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(),
                               reference(x.astype("float64")), rtol=1e-5, atol=1e-6)


def test_column_reduction_walks_rows_inside_column_bands():
    @I.ir_module
    class ColumnSum:
        @R.function
        def main(x: R.Tensor((1024, 512), "float32")):
            with R.dataflow():
                z = R.collapse_sum_to(x, R.shape([512]))  # a bias gradient
                R.output(z)
            return z

    scheduled = ScheduleCPU()(_lowered(ColumnSum))
    prims = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    kinds = _loop_kinds(prims[0])
    # 8 parallel bands of 64 columns (whole cache lines; 8 columns was 3.8x slower); inside,
    # rows in order (1024), then the band's 64 contiguous columns
    assert (tirx.ForKind.PARALLEL, 8) in kinds
    assert (tirx.ForKind.SERIAL, 1024) in kinds
    assert (tirx.ForKind.SERIAL, 64) in kinds
    x = np.random.default_rng(1).standard_normal((1024, 512)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), x.sum(0), rtol=1e-4,
                               atol=1e-4)


@I.ir_module
class WholeSum:
    """A reduction of 256*512 elements to one scalar: no data-parallel loop to split, which
    ScheduleCPU does not handle (it factors a row's reduction into vector lanes, not a whole
    tensor's across threads)."""

    @R.function
    def main(x: R.Tensor((256, 512), "float32")):
        with R.dataflow():
            z = R.sum(x)
            R.output(z)
        return z


def test_unhandled_block_is_logged_and_left_serial(caplog):
    with caplog.at_level(logging.WARNING, logger="raf_dist"):
        scheduled = ScheduleCPU(strict=False)(_lowered(WholeSum))
    (kernel,) = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert all(kind == tirx.ForKind.SERIAL for kind, _ in _loop_kinds(kernel))
    (record,) = [r for r in caplog.records if "left unscheduled" in r.getMessage()]
    message = record.getMessage()
    assert "'sum'" in message and "no data-parallel outer loop" in message, message
    x = np.random.default_rng(2).standard_normal((256, 512)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    # float32 sum of 131072 standard normals in two different orders
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), x.sum(), rtol=1e-3)


def test_strict_mode_raises_on_a_fallback(monkeypatch):
    monkeypatch.setenv("RAF_DIST_STRICT_SCHEDULE", "1")  # what tests/conftest.py sets anyway
    with pytest.raises(ScheduleFallbackError, match=r"kernel 'sum', block 'x_red'.*RAF_DIST_STRICT"):
        ScheduleCPU()(_lowered(WholeSum))
    monkeypatch.setenv("RAF_DIST_STRICT_SCHEDULE", "maybe")
    with pytest.raises(ValueError, match="RAF_DIST_STRICT_SCHEDULE='maybe' is not a switch"):
        ScheduleCPU()(_lowered(WholeSum))


def test_tvm_prescheduled_kernels_are_left_alone():
    lowered = _lowered(Elementwise)
    gvar, func = [(g, f) for g, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)][0]
    lowered = lowered.clone()
    lowered[gvar] = func.with_attr("tirx.is_scheduled", True)  # TVM 0.27's attribute
    kept = ScheduleCPU()(lowered)[gvar]
    assert all(kind == tirx.ForKind.SERIAL for kind, _ in _loop_kinds(kept))
    fresh = ScheduleCPU()(_lowered(Elementwise))[gvar.name_hint]
    assert int(fresh.attrs["tirx.is_scheduled"]) == 1


def _embedding_gradient(vocab, dim, rows):
    bb = relax.BlockBuilder()
    g = relax.Var("g", relax.TensorType((rows, dim), "float32"))
    x = relax.Var("x", relax.TensorType((vocab, dim), "float32"))
    idx = relax.Var("idx", relax.TensorType((rows,), "int32"))
    with bb.function("main", [g, x, idx]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.take_backward(g, x, idx, 0))
        bb.emit_func_output(out)
    return bb.get()


def test_embedding_gradient_runs_parallel_and_adds_repeated_rows():
    """TVM's take_backward is an opaque block Schedule() cannot open ("Cannot find a block
    with the name: root"): it used to be left serial without a word on every model with an
    embedding. Its zeroing loop now runs in parallel, its accumulation in parallel bands of
    16 columns, each walking the rows in order; repeated indices still add up."""
    vocab, dim, rows = 512, 128, 1024  # the GPT of bench/step_time.py
    scheduled = ScheduleCPU()(_lowered(_embedding_gradient(vocab, dim, rows)))
    (kernel,) = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    kinds = _loop_kinds(kernel)
    # (innermost first) 16 contiguous columns inside the walk over the rows, 8 parallel bands
    assert kinds == [(tirx.ForKind.PARALLEL, vocab * dim), (tirx.ForKind.SERIAL, 16),
                     (tirx.ForKind.SERIAL, rows), (tirx.ForKind.PARALLEL, dim // 16)]
    rng = np.random.default_rng(3)
    idx = rng.integers(0, vocab, rows).astype("int32")
    idx[:9] = 7  # a row hit repeatedly
    g = rng.standard_normal((rows, dim)).astype("float32")
    expected = np.zeros((vocab, dim), "float32")
    np.add.at(expected, idx, g)
    vm = relax.VirtualMachine(tvm.compile(scheduled, target="llvm"), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(g), tvm.runtime.tensor(np.zeros_like(expected)),
                     tvm.runtime.tensor(idx))
    # the same additions in the same order per element as np.add.at
    np.testing.assert_array_equal(out.numpy(), expected)


def test_cpu_build_prints_no_unknown_pragma(capfd, tmp_path):
    """TVM's IR builder wraps take_backward's loops in a ``pragma_scope`` attribute LLVM's code
    generator does not know; DropScopePragma removes it, so the build prints no warning."""
    compile_step(_embedding_gradient(24, 16, 64), cache_dir=tmp_path)
    assert "Unknown pragma" not in capfd.readouterr().err
