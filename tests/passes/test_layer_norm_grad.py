"""Layer norm's fused backward (training/layer_norm.py): autodiff emits the two row-wise ops
(static shapes; the Relax decomposition otherwise), their gradients match PyTorch's (within
its own float32 spread) through raf_dist's CPU schedule (strict: a kernel left serial fails
the test), and the input gradient is one parallel loop over the rows."""
import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax, tirx

import raf_dist.training.gradients  # noqa: F401  (registers layer norm's gradient)
from raf_dist.compiler import build
from raf_dist.compiler.schedule_cpu import ScheduleCPU
from raf_dist.ir.ops import LAYER_NORM_GRAD, LAYER_NORM_GRAD_WEIGHT

op = relax.op


def _ops(func):
    names = []
    relax.analysis.post_order_visit(func, lambda e: names.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


def _adjoint(shape, axes, dtype, weight):
    """main(x, gamma, beta) = sum(layer_norm(x) * weight) and its adjoint."""
    normalised = [shape[a] for a in axes]
    params = [relax.Var("x", relax.TensorType(shape, dtype)),
              relax.Var("gamma", relax.TensorType(normalised, dtype)),
              relax.Var("beta", relax.TensorType(normalised, dtype))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(op.nn.layer_norm(*params, axes=axes, epsilon=1e-5))
            # summed a row at a time first: a reduction of the whole tensor to one value is a
            # shape ScheduleCPU leaves serial (a strict-mode failure unrelated to layer norm)
            rows = bb.emit(op.sum(op.multiply(y, relax.const(weight, dtype)), axis=[-1]))
            loss = bb.emit_output(bb.emit(op.sum(rows)))
        bb.emit_func_output(loss)
    return relax.transform.Gradient("main")(bb.get())


def test_autodiff_emits_the_two_fused_ops():
    fused = _ops(_adjoint((4, 6, 8), [2], "float32", np.ones((4, 6, 8), "float32"))[
        "main_adjoint"])
    assert fused.count(LAYER_NORM_GRAD) == 1 and fused.count(LAYER_NORM_GRAD_WEIGHT) == 1
    assert "relax.mean" not in fused and "relax.rsqrt" not in fused


@pytest.mark.parametrize("shape,axes", [((16, 64, 128), [2]), ((4, 6, 5, 24), [2, 3]),
                                        ((64, 20), [1])])
def test_gradients_within_pytorchs_own_float32_spread(shape, axes, tmp_path):
    """float32 through raf_dist's compiler against PyTorch's float64 autograd; the tolerance
    is PyTorch's own float32-vs-float64 spread on the same case, x2 (TVM's forward layer norm
    does not legalise in float64, so the step cannot run in float64)."""
    rng = np.random.default_rng(3)
    normalised = [shape[a] for a in axes]
    x = (rng.standard_normal(shape) * 4 + 2).astype("float32")
    gamma, beta = (rng.standard_normal(normalised).astype("float32") for _ in range(2))
    weight = rng.standard_normal(shape).astype("float32")
    mod = _adjoint(shape, axes, "float32", weight)
    mod = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint == "main_adjoint"})
    vm = relax.VirtualMachine(build.compile_step(mod, cache_dir=tmp_path / "c").executable,
                              tvm.cpu())
    _, grads = vm["main_adjoint"](*(tvm.runtime.tensor(a) for a in (x, gamma, beta)))

    def torch_grads(dtype):
        tx, tg, tb = (torch.tensor(a, dtype=dtype, requires_grad=True) for a in (x, gamma, beta))
        (torch.nn.functional.layer_norm(tx, normalised, tg, tb, eps=1e-5)
         * torch.tensor(weight, dtype=dtype)).sum().backward()
        return [t.grad.double().numpy() for t in (tx, tg, tb)]

    exact, single = torch_grads(torch.float64), torch_grads(torch.float32)
    for got, ref, peer in zip(grads, exact, single):
        spread = np.abs(peer - ref).max()
        assert np.abs(got.numpy() - ref).max() <= 2 * spread + 1e-7


def _op_module(op_name, args):
    """main(*args) = op(*args), float32 (name, shape) arguments."""
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in args]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.Call(
                tvm.ir.Op.get(op_name), params,
                attrs=tvm.ir.make_node("ir.DictAttrs", epsilon=1e-5))))
        bb.emit_func_output(out)
    return bb.get()


def _scheduled_kernel(op_name, args):
    """The one PrimFunc of main(*args) = op(*args), legalised and fused as the step's
    pipeline does, then ScheduleCPU (strict)."""
    with tvm.target.Target("llvm"):
        lowered = tvm.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(), relax.transform.FuseTIR()])(_op_module(op_name, args))
    scheduled = ScheduleCPU(strict=True)(lowered)
    (kernel,) = [f for _, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)]
    return kernel


def _loops(kernel, kind):
    found = []
    tvm_ffi.structural_walk(kernel.body, [(tirx.For, lambda loop: found.append(loop)
                                           if loop.kind == kind else None)])
    return found


def test_input_gradient_is_one_parallel_loop_over_rows():
    """The dx kernel row-fused: its four row reductions and the output inside one parallel loop
    over the 256 rows, the reductions' partial sums and the output vectorised."""
    kernel = _scheduled_kernel(LAYER_NORM_GRAD, [("x", (256, 64)), ("gamma", (64,)),
                                                 ("dy", (256, 64))])
    (rows,) = _loops(kernel, tirx.ForKind.PARALLEL)
    assert int(rows.extent) == 256
    inside, everywhere = set(), set()
    tvm_ffi.structural_walk(rows.body, [(tvm.s_tir.SBlock, lambda b: inside.add(b.name_hint))])
    tvm_ffi.structural_walk(kernel.body, [(tvm.s_tir.SBlock, lambda b: everywhere.add(
        b.name_hint))])
    assert everywhere - {"root"} == inside
    assert len(_loops(kernel, tirx.ForKind.VECTORIZED)) >= 5  # 4 reductions' lanes, the output


def test_weight_gradient_walks_column_bands_in_parallel():
    kernel = _scheduled_kernel(LAYER_NORM_GRAD_WEIGHT, [("x", (1024, 512)), ("dy", (1024, 512))])
    assert _loops(kernel, tirx.ForKind.PARALLEL)  # the row statistics and the column bands


def test_16_bit_inputs_are_read_as_they_are(tmp_path, monkeypatch):
    """A bf16 step's backward widens x and dy for the ops (reshape(astype(u, float32)));
    read_16_bit_inputs makes the ops read the bf16 tensors, widening as they load, with
    float32 results: no widened tensor is left for them, the kernels still schedule
    strictly, and dx / dgamma / dbeta are the same bits."""
    import ml_dtypes

    from raf_dist.training.layer_norm import read_16_bit_inputs

    monkeypatch.setenv("RAF_DIST_STRICT_SCHEDULE", "1")
    shape, rows, cols = (4, 32, 64), 128, 64
    x16 = relax.Var("x", relax.TensorType(shape, "bfloat16"))
    gamma = relax.Var("gamma", relax.TensorType((cols,), "float32"))
    dy16 = relax.Var("dy", relax.TensorType(shape, "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x16, gamma, dy16]):
        with bb.dataflow():
            xr = bb.emit(op.reshape(bb.emit(op.astype(x16, "float32")), (rows, cols)))
            dyr = bb.emit(op.reshape(bb.emit(op.astype(dy16, "float32")), (rows, cols)))
            eps = tvm.ir.make_node("ir.DictAttrs", epsilon=1e-5)
            dx = bb.emit(relax.Call(tvm.ir.Op.get(LAYER_NORM_GRAD), [xr, gamma, dyr], eps))
            dg = bb.emit(relax.Call(tvm.ir.Op.get(LAYER_NORM_GRAD_WEIGHT), [xr, dyr], eps))
            db = bb.emit(op.sum(dyr, axis=[0]))
            out = bb.emit_output(relax.Tuple([dx, dg, db]))
        bb.emit_func_output(out)
    before = bb.get()["main"]
    after = read_16_bit_inputs(before)
    calls = [b.value for b in after.body.blocks[0].bindings if isinstance(b.value, relax.Call)
             and b.value.op.name in (LAYER_NORM_GRAD, LAYER_NORM_GRAD_WEIGHT)]
    assert len(calls) == 2
    for call in calls:
        assert str(call.args[0].ty.dtype) == str(call.args[-1].ty.dtype) == "bfloat16"
        assert str(call.attrs["out_dtype"]) == "float32" and str(call.ty.dtype) == "float32"

    rng = np.random.default_rng(0)
    args = [rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
            rng.standard_normal(cols).astype("float32"),
            rng.standard_normal(shape).astype(ml_dtypes.bfloat16)]

    def run(func, name):
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        vm = relax.VirtualMachine(build.compile_step(mod, cache_dir=tmp_path / name).executable,
                                  tvm.cpu())
        return [t.numpy() for t in vm["main"](*(tvm.runtime.tensor(a) for a in args))]

    for got, ref in zip(run(after, "low"), run(before, "widened")):
        np.testing.assert_array_equal(got, ref)


def _weight_gradient_module(rows, cols):
    return _op_module(LAYER_NORM_GRAD_WEIGHT, [("x", (rows, cols)), ("dy", (rows, cols))])


@pytest.mark.parametrize("rows, cols", [(1024, 128), (2048, 512)])
def test_gpu_weight_gradient_spreads_over_blocks(rows, cols):
    """On a GPU the weight gradient is two kernels, each launched on many blocks: the one
    reduction over every row that the host's lowering is got a single block of threads from dlight
    (0.77-1.3 ms a call on an H200, 37-44% of the GPT steps' time: bench/RESULTS.md). Only
    the schedule is checked here (no GPU needed)."""
    from raf_dist.compiler.schedule_gpu import ScheduleGPU

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm")
    with target, tvm.transform.PassContext(opt_level=3):
        lowered = tvm.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(), relax.transform.FuseTIR(), ScheduleGPU()])(
                _weight_gradient_module(rows, cols))
    kernels = [f for _, f in lowered.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert len(kernels) == 2
    for kernel in kernels:
        blocks = 1
        found = []
        tvm_ffi.structural_walk(kernel.body, [(tirx.For, lambda loop: found.append(
            int(loop.extent)) if loop.thread_binding is not None
            and str(loop.thread_binding.thread_tag).startswith("blockIdx") else None)])
        for extent in found:
            blocks *= extent
        assert blocks >= 8, kernel  # the column sums: C / 16 blocks


def test_gpu_weight_gradient_lowering_as_pytorch(tmp_path):
    """The GPU's lowering (legalised under a CUDA target, then built and run here) gives
    gamma's gradient within PyTorch's own float32-vs-float64 spread x2, as the host's does."""
    rng = np.random.default_rng(5)
    rows, cols = 1024, 128
    x = (rng.standard_normal((rows, cols)) * 4 + 2).astype("float32")
    dy = rng.standard_normal((rows, cols)).astype("float32")
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host="llvm"):
        mod = relax.transform.LegalizeOps()(_weight_gradient_module(rows, cols))
    assert {gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)} \
        == {"layer_norm_xhat_dy", "layer_norm_grad_weight"}  # the GPU's two kernels
    vm = relax.VirtualMachine(build.compile_step(mod, cache_dir=tmp_path).executable, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(dy)).numpy()

    def torch_grad(dtype):
        tx = torch.tensor(x, dtype=dtype)
        gamma = torch.ones(cols, dtype=dtype, requires_grad=True)
        (torch.nn.functional.layer_norm(tx, [cols], gamma, eps=1e-5)
         * torch.tensor(dy, dtype=dtype)).sum().backward()
        return gamma.grad.double().numpy()

    exact = torch_grad(torch.float64)
    spread = np.abs(torch_grad(torch.float32) - exact).max()
    assert np.abs(got - exact).max() <= 2 * spread + 1e-7
