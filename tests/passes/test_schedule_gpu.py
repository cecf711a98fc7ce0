"""IR tier for the GPU schedules dlight lacks: take_backward (the embedding gradient), which no
dlight rule takes: two kernels over GPU threads, and — run on the CPU with the same grid as
serial loops — the same result as numpy's unbuffered scatter-add, repeated indices included;
and the mean of nll_loss (reductions to one value), which dlight's GeneralReduction turned
into a kernel launch per token; the fused cross-entropy's kernels (training/cross_entropy.py)."""
import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.compiler.schedule_gpu import (ScalarReductions, launches_once,
                                            schedule_gpu_prim_func, schedule_scatter_add)
from raf_dist.training.loss import build_loss

V, D, N = 37, 11, 50  # V*D = 407 elements: two blocks of 256 threads, the second one partial


def _take_backward(axis):
    x_shape = (V, D) if axis == 0 else (D, V)
    g_shape = (N, D) if axis == 0 else (D, N)

    bb = relax.BlockBuilder()
    g = relax.Var("g", relax.TensorType(g_shape, "float32"))
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    idx = relax.Var("idx", relax.TensorType((N,), "int32"))
    with bb.function("main", [g, x, idx]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.take_backward(g, x, idx, axis))
        bb.emit_func_output(out)
    with tvm.target.Target("llvm"):
        mod = relax.transform.LegalizeOps()(bb.get())
    (gvar, func), = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    return mod, gvar, func


def _loops(func):
    loops = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, lambda loop: loops.append(
        (loop.kind, int(loop.extent), loop.thread_binding.thread_tag
         if loop.thread_binding is not None else None)))])
    return loops


@pytest.mark.parametrize("axis", [0, 1])
def test_take_backward_becomes_two_thread_grids(axis):
    _, _, func = _take_backward(axis)
    scheduled = schedule_scatter_add(func)
    bound = [(extent, tag) for kind, extent, tag in _loops(scheduled)
             if kind == tirx.ForKind.THREAD_BINDING]
    # (innermost loop first) zeroing: a thread per output element, 407 = 2 blocks of 256;
    # accumulation: a thread per output column
    assert bound == [(256, "threadIdx.x"), (2, "blockIdx.x"), (D, "threadIdx.x"), (1, "blockIdx.x")]
    # the walk over the indices stays a serial loop inside each column's thread
    assert (tirx.ForKind.SERIAL, N, None) in _loops(scheduled)
    assert int(scheduled.attrs["tirx.is_scheduled"]) == 1


def test_other_kernels_are_left_to_dlight():
    @I.ir_module
    class Add:
        @R.function
        def main(x: R.Tensor((4,), "float32")):
            with R.dataflow():
                y = R.add(x, x)
                R.output(y)
            return y

    with tvm.target.Target("llvm"):
        mod = relax.transform.LegalizeOps()(Add)
    func = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)][0]
    assert schedule_scatter_add(func) is None


@pytest.mark.parametrize("axis", [0, 1])
def test_the_grid_computes_the_scatter_add(axis):
    """The rewrite's index arithmetic (block * 256 + thread, the guard on the last block), run
    on the CPU: the grid as serial loops gives numpy's scatter-add, repeated indices summed."""
    mod, gvar, func = _take_backward(axis)
    mod = mod.clone()
    mod[gvar] = schedule_scatter_add(func, bind=False)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    rng = np.random.default_rng(0)
    idx = rng.integers(0, V, N).astype("int32")
    idx[:5] = 3  # a row hit repeatedly
    g_shape = (N, D) if axis == 0 else (D, N)
    g = rng.standard_normal(g_shape).astype("float32")
    x = np.zeros((V, D) if axis == 0 else (D, V), "float32")
    expected = np.zeros_like(x)
    if axis == 0:
        np.add.at(expected, idx, g)
    else:
        np.add.at(expected.T, idx, g.T)
    out = vm["main"](tvm.runtime.tensor(g), tvm.runtime.tensor(x), tvm.runtime.tensor(idx))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)


CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")


def _nll_loss_mean(rows=1024, classes=512):
    bb = relax.BlockBuilder()
    logp = relax.Var("logp", relax.TensorType((rows, classes), "float32"))
    target = relax.Var("target", relax.TensorType((rows,), "int64"))
    with bb.function("main", [logp, target]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.nll_loss(logp, target, reduction="mean"))
        bb.emit_func_output(out)
    with CUDA:
        mod = relax.transform.LegalizeOps()(bb.get())
    return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)][0]


def test_dlight_launched_the_loss_mean_once_per_token():
    """Why ScalarReductions exists: dlight's GeneralReduction takes TVM's legalised nll_loss
    (two sums to one value, then their quotient) and binds each sum's one-element grid inside
    the serial loop over the tokens — a loop left on the host, one kernel launch per token."""
    from tvm.s_tir import dlight as dl
    with CUDA:
        dlight = dl.gpu.GeneralReduction().apply(_nll_loss_mean(), CUDA, False)
    assert dlight is not None and not launches_once(dlight.mod["main"])


def test_the_loss_mean_is_three_kernels_launched_once():
    with CUDA:
        scheduled = schedule_gpu_prim_func(_nll_loss_mean(), CUDA)
    assert launches_once(scheduled)
    bound = [(extent, tag) for kind, extent, tag in _loops(scheduled)
             if kind == tirx.ForKind.THREAD_BINDING]
    # each sum: one block of 256 threads, each thread summing 1024 / 256 = 4 tokens (a serial
    # loop inside the kernel) before the cross-thread combine; the quotient: one block
    assert bound.count((256, "threadIdx.x")) == 2 and bound.count((1, "blockIdx.x")) == 3
    assert (tirx.ForKind.SERIAL, 4, None) in _loops(scheduled)
    with CUDA:  # the generated CUDA C: three kernels, the sums combined with warp shuffles
        source = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}),
                             target=CUDA).mod.imports[0].inspect_source()
    kernels = set(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", source))
    assert len(kernels) == 3 and "__shfl_down_sync" in source


def test_scalar_reductions_declines_reductions_with_many_outputs():
    """A row-wise reduction (a softmax's max and sum per row) is Reduction's / GeneralReduction's
    work: ScalarReductions takes only a kernel where some sum has a single output element."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 32), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sum(x, axis=1))
        bb.emit_func_output(out)
    with CUDA:
        mod = relax.transform.LegalizeOps()(bb.get())
        func = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)][0]
        assert ScalarReductions().apply(func, CUDA, False) is None


def _cross_entropy_kernels(shape, dtype):
    func, _ = build_loss("cross_entropy", shape, dtype)
    mod = tvm.IRModule({tvm.ir.GlobalVar("main"): func.with_attr("global_symbol", "main")})
    mod = relax.transform.Gradient("main")(mod)
    with CUDA:
        mod = relax.transform.LegalizeOps()(mod)
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


# (64, 50257): GPT-2's vocabulary, whose statistics run on a copy padded to whole CPU vectors
@pytest.mark.parametrize("shape", [(512, 4096), (64, 50257)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_cross_entropy_kernels_are_spread_over_threads(dtype, shape):
    """training/cross_entropy.py's two kernels (row statistics, the gradient) through
    ScheduleGPU's rules: one launch each, every row's work over many threads."""
    kernels = _cross_entropy_kernels(shape, dtype)
    assert {"cross_entropy_rows", "cross_entropy_grad"} <= set(kernels)
    for name in ("cross_entropy_rows", "cross_entropy_grad"):
        with CUDA:
            scheduled = schedule_gpu_prim_func(kernels[name], CUDA)
        assert scheduled is not None and launches_once(scheduled), name
        threads = [extent for kind, extent, tag in _loops(scheduled)
                   if kind == tirx.ForKind.THREAD_BINDING and tag == "threadIdx.x"]
        # every row's work spread over threads, not one thread per kernel (Fallback's last
        # resort) nor one launch per row
        assert threads and min(threads) > 1, name


def test_layer_norm_backward_kernels_are_spread_over_threads():
    """training/layer_norm.py's kernels on a GPU (dx; dgamma as dy * xhat, then its column
    sums) through ScheduleGPU's rules: one launch each, over many threads and more than one
    block (dgamma as one kernel got a single block: 0.77 ms a call on an H200)."""
    from raf_dist.ir.ops import LAYER_NORM_GRAD, LAYER_NORM_GRAD_WEIGHT
    import raf_dist.training.layer_norm  # noqa: F401  (registers the ops' lowering)

    params = [relax.Var("x", relax.TensorType((512, 768), "float32")),
              relax.Var("gamma", relax.TensorType((768,), "float32")),
              relax.Var("dy", relax.TensorType((512, 768), "float32"))]
    attrs = tvm.ir.make_node("ir.DictAttrs", epsilon=1e-5)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            dx = bb.emit(relax.Call(tvm.ir.Op.get(LAYER_NORM_GRAD), params, attrs=attrs))
            dgamma = bb.emit(relax.Call(tvm.ir.Op.get(LAYER_NORM_GRAD_WEIGHT),
                                        [params[0], params[2]], attrs=attrs))
            out = bb.emit_output(relax.Tuple([dx, dgamma]))
        bb.emit_func_output(out)
    with CUDA:
        mod = relax.transform.LegalizeOps()(bb.get())
    kernels = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    names = ("layer_norm_grad", "layer_norm_xhat_dy", "layer_norm_grad_weight")
    assert set(names) <= set(kernels)
    for name in names:
        with CUDA:
            scheduled = schedule_gpu_prim_func(kernels[name], CUDA)
        assert scheduled is not None and launches_once(scheduled), name
        threads = [extent for kind, extent, tag in _loops(scheduled)
                   if kind == tirx.ForKind.THREAD_BINDING and tag == "threadIdx.x"]
        blocks = [extent for kind, extent, tag in _loops(scheduled)
                  if kind == tirx.ForKind.THREAD_BINDING and tag == "blockIdx.x"]
        assert threads and min(threads) > 1 and max(blocks) > 1, name
