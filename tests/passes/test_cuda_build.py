"""The CUDA build without a GPU: the training step (data parallel and ZeRO) of every test
model compiles for an NVIDIA target — every generated kernel gets a GPU schedule (CUDA
codegen rejects a kernel with unbound loops) and the generated CUDA C compiles to sm_80
machine code with the compiler a GPU host would use (nvcc here). Needs nvcc (skipped
otherwise); running the result needs a GPU (tests/gpu)."""
import re
import shutil

import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.support import nvcc

import raf_dist
from models import make, raf_optimizer
from raf_dist.compiler import compile_step
from raf_dist.compiler import schedule_gpu
from raf_dist.device import cuda_compiler
from raf_dist.compiler.step_passes import step_passes
from raf_dist.training import build_train_step

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")


def _step(name):
    module, x, _ = make(name, 4)
    mod, _ = build_train_step(raf_dist.frontend.from_pytorch(module, (x,)), "cross_entropy",
                              raf_optimizer("adamw"))
    return mod


def _thread_loops(func):
    loops = []
    tvm_ffi.structural_walk(func.body, [(tvm.tirx.For, lambda loop: loops.append(loop)
                                         if loop.thread_binding is not None else None)])
    return loops


def _modules(executable):
    found, todo = [], [executable.mod]
    while todo:
        m = todo.pop()
        found.append(m)
        todo.extend(m.imports)
    return found


@pytest.mark.parametrize("name, level", [("mlp", 0), ("cnn", 2), ("transformer", 3)])
def test_training_step_compiles_for_cuda(name, level, tmp_path):
    compiled = compile_step(_step(name), passes=step_passes(level, 2, 1000), target=TARGET,
                            cache_dir=tmp_path)
    cuda = [m for m in _modules(compiled.executable) if m.kind == "cuda"]
    assert cuda and compiled.planned_peak_bytes > 0
    # Without a GPU, TVM keeps the kernels as CUDA C (it compiles them where a CUDA runtime
    # is loaded): compile them here with the compiler a GPU host would use, to machine code
    with TARGET:
        cubin = nvcc.compile_cuda(cuda[0].inspect_source(), target_format="cubin",
                                  compiler=cuda_compiler())
    assert len(cubin) > 1000
    if name == "transformer":  # the embedding gradient: a zeroing and an accumulating kernel
        # (read from the generated CUDA C: without a GPU the module cannot be loaded to ask it)
        kernels = re.findall(r"__global__ void __launch_bounds__\((\d+)\) (take_backward\w*)\(",
                             cuda[0].inspect_source())
        assert set(kernels) == {("16", "take_backward_kernel_1"), ("256", "take_backward_kernel")}


def test_every_kernel_gets_a_gpu_schedule(monkeypatch):
    from tvm.relax.backend.cuda import pipeline
    one_thread = []
    monkeypatch.setattr(schedule_gpu, "run_on_one_gpu_thread",
                        lambda func: one_thread.append(func) or func)
    mod = _step("transformer")
    for p in step_passes(0, 1, 1000):
        mod = p(mod)
    with TARGET, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(pipeline.library_dispatch_passes(TARGET)
                                       + pipeline.legalize_passes(TARGET)[:-1])(mod)
        scheduled = schedule_gpu.ScheduleGPU()(mod)
    kernels = {gv.name_hint: f for gv, f in scheduled.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc)}
    assert kernels and all(int(f.attrs["tirx.is_scheduled"]) == 1 for f in kernels.values())
    # every kernel of the step has a real schedule: dlight's, or schedule_scatter_add for the
    # embedding gradient (take_backward, which every dlight rule declines) — none falls back
    # to a single GPU thread
    assert one_thread == []
    # and every kernel starts once per step (no host loop around a launch: the loss's mean
    # was once a launch per token, see test_schedule_gpu.py)
    assert all(schedule_gpu.launches_once(f) for f in kernels.values())
    assert len(_thread_loops(kernels["take_backward"])) == 4  # two kernels: block x thread
    relax.analysis.well_formed(scheduled)


def test_the_last_resort_runs_a_kernel_on_one_thread():
    from tvm.relax.backend.cuda import pipeline
    mod = _step("transformer")
    with TARGET, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(pipeline.library_dispatch_passes(TARGET)
                                       + pipeline.legalize_passes(TARGET)[:-1])(mod)
    extents = []
    tvm_ffi.structural_walk(schedule_gpu.run_on_one_gpu_thread(mod["take_backward"]).body, [
        (tvm.tirx.AttrStmt, lambda a: extents.append(int(a.value))
         if a.attr_key == "thread_extent" else None)])
    assert extents == [1, 1]  # one block of one thread
