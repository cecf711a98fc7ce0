"""The CUDA build without a GPU: the training step (data parallel and ZeRO) of every test
model compiles for an NVIDIA target — every generated kernel gets a GPU schedule (CUDA
codegen rejects a kernel with unbound loops) and nvcc accepts the code. Needs nvcc (skipped
otherwise); running the result needs a GPU (tests/gpu)."""
import shutil

import pytest
import tvm
from tvm import relax

import raf_dist
from models import make, raf_optimizer
from raf_dist.compiler import compile_step
from raf_dist.compiler.schedule import ScheduleGPU, run_on_one_gpu_thread
from raf_dist.trainer import step_passes
from raf_dist.training import build_train_step

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")


def _step(name):
    module, x, _ = make(name, 4)
    mod, _ = build_train_step(raf_dist.frontend.from_pytorch(module, (x,)), "cross_entropy",
                              raf_optimizer("adamw"))
    return mod


def _module_kinds(executable):
    kinds, todo = [], [executable.mod]
    while todo:
        m = todo.pop()
        kinds.append(m.kind)
        todo.extend(m.imports)
    return kinds


@pytest.mark.parametrize("name, level", [("mlp", 0), ("cnn", 2), ("transformer", 3)])
def test_training_step_compiles_for_cuda(name, level, tmp_path):
    compiled = compile_step(_step(name), passes=step_passes(level, 2, 1000), target=TARGET,
                            cache_dir=tmp_path)
    assert "cuda" in _module_kinds(compiled.executable)
    assert compiled.planned_peak_bytes > 0


def test_every_kernel_gets_a_gpu_schedule():
    from tvm.relax.backend.cuda import pipeline
    mod = _step("transformer")
    for p in step_passes(0, 1, 1000):
        mod = p(mod)
    with TARGET, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(pipeline.library_dispatch_passes(TARGET)
                                       + pipeline.legalize_passes(TARGET)[:-1])(mod)
        scheduled = ScheduleGPU()(mod)
    kernels = {gv.name_hint: f for gv, f in scheduled.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc)}
    assert kernels and all(int(f.attrs["tirx.is_scheduled"]) == 1 for f in kernels.values())
    # take_backward (the embedding gradient's scatter-add) is declined by every dlight rule:
    # it runs on one GPU thread
    assert kernels["take_backward"].script().count("T.launch_thread") == 2
    assert run_on_one_gpu_thread(mod["take_backward"]).script().count("T.launch_thread") == 2
    relax.analysis.well_formed(scheduled)
