"""AddLookupGradient (passes/lookup_gradient.py): a tied table's gradient, dense + the lookups'
scatter-add, as one kernel writing the result; as close to the float64 sum as take_backward +
add."""
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op

from raf_dist.compiler import build
from raf_dist.passes.lookup_gradient import AddLookupGradient

VOCAB, DIM, TOKENS = 96, 32, 40


def _tied(dense_dtype, extra_use=False):
    """main(W, dense gradient (dense_dtype), dy, ids) -> the table's gradient (float32):
    astype(dense) when it is 16-bit, plus take_backward(dy, W, ids)."""
    table = relax.Var("W", relax.TensorType((VOCAB, DIM), "float32"))
    dense = relax.Var("dW", relax.TensorType((VOCAB, DIM), dense_dtype))
    dy = relax.Var("dy", relax.TensorType((TOKENS, DIM), "float32"))
    ids = relax.Var("ids", relax.TensorType((TOKENS,), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [table, dense, dy, ids]):
        with bb.dataflow():
            wide = dense if dense_dtype == "float32" else bb.emit(op.astype(dense, "float32"))
            rows = bb.emit(op.grad.take_backward(dy, table, ids, axis=0))
            grad = bb.emit(op.add(rows, wide))  # the lookup's first: either order matches
            outs = [grad, op.sum(wide)] if extra_use else [grad]
            out = bb.emit_output(relax.Tuple(outs) if extra_use else grad)
        bb.emit_func_output(out)
    return bb.get()


def _calls(mod):
    return [b.value for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call)]


def _run(mod, args, path):
    """The table's gradient ``mod`` computes from ``args``."""
    vm = relax.VirtualMachine(build.compile_step(mod, cache_dir=path).executable, tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in args)).numpy()


@pytest.mark.parametrize("dense_dtype", ["float32", "bfloat16"])
def test_one_kernel_same_bits(dense_dtype, tmp_path):
    """Before: [astype], take_backward, add. Expected: one call_tir of take_backward_add
    reading the dense gradient as it is (the 16-bit one, not its widening); no vocabulary-
    sized scatter tensor. Repeated ids (as a batch of tokens has): the rows are added onto the
    dense gradient one by one, where the two ops added their sum once (float32 rounding
    apart, the same sum): within twice the two ops' own distance from the float64 sum, and
    exactly equal on the rows no id looks up."""
    import ml_dtypes

    before = _tied(dense_dtype)
    after = AddLookupGradient()(before)
    calls = _calls(after)
    assert len(calls) == 1 and calls[0].op.name == "relax.call_tir", after["main"].script()
    assert calls[0].args[0].name_hint == "take_backward_add"
    assert str(calls[0].args[1].fields[0].ty.dtype) == dense_dtype  # read as it is
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((VOCAB, DIM)).astype(
        "float32" if dense_dtype == "float32" else ml_dtypes.bfloat16)
    ids = rng.integers(0, VOCAB // 4, TOKENS).astype("int64")  # many repeats
    args = [rng.standard_normal((VOCAB, DIM)).astype("float32"), dense,
            rng.standard_normal((TOKENS, DIM)).astype("float32"), ids]
    got = _run(after, args, tmp_path / "after")
    ref = _run(before, args, tmp_path / "before")
    exact = np.asarray(dense, dtype="float64")
    np.add.at(exact, ids, args[2].astype("float64"))
    ref_err = np.abs(ref - exact).max()
    assert 0 < ref_err < 1e-5  # float32 rounding of sums of a few unit normals
    assert np.abs(got - exact).max() <= 2 * ref_err, (np.abs(got - exact).max(), ref_err)
    untouched = np.setdiff1d(np.arange(VOCAB), ids)
    np.testing.assert_array_equal(got[untouched], ref[untouched])


def test_a_widening_read_elsewhere_is_kept():
    """The 16-bit dense gradient's widening is also read by another op: the kernel reads the
    widened value (float32) and the astype stays."""
    after = AddLookupGradient()(_tied("bfloat16", extra_use=True))
    names = [c.op.name if c.op.name != "relax.call_tir" else c.args[0].name_hint
             for c in _calls(after)]
    assert "relax.astype" in names and "take_backward_add" in names
    fused = next(c for c in _calls(after) if c.op.name == "relax.call_tir"
                 and c.args[0].name_hint == "take_backward_add")
    assert str(fused.args[1].fields[0].ty.dtype) == "float32"
    assert "relax.grad.take_backward" not in names


def test_untied_lookup_is_left_alone():
    """A lookup's scatter-add that is the table's whole gradient (no add) stays TVM's."""
    table = relax.Var("W", relax.TensorType((VOCAB, DIM), "float32"))
    dy = relax.Var("dy", relax.TensorType((TOKENS, DIM), "float32"))
    ids = relax.Var("ids", relax.TensorType((TOKENS,), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [table, dy, ids]):
        with bb.dataflow():
            out = bb.emit_output(op.grad.take_backward(dy, table, ids, axis=0))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(AddLookupGradient()(mod), mod)


def test_gpu_schedule_of_the_kernel(monkeypatch, tmp_path):
    """The kernel keeps take_backward's block: the GPU's scatter-add schedule takes it (two
    launches, block x thread each), none falls back to one GPU thread; the CUDA C compiles
    where nvcc is (tests/passes/test_cuda_build.py's check)."""
    import shutil

    from tvm.relax.backend.cuda import pipeline

    from raf_dist.compiler import schedule_gpu
    from raf_dist.device import cuda_compiler

    one_thread = []
    monkeypatch.setattr(schedule_gpu, "run_on_one_gpu_thread",
                        lambda func: one_thread.append(func) or func)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}, host="llvm")
    mod = AddLookupGradient()(_tied("bfloat16"))
    with target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(pipeline.library_dispatch_passes(target)
                                       + pipeline.legalize_passes(target)[:-1])(mod)
        scheduled = schedule_gpu.ScheduleGPU()(mod)
    assert one_thread == []
    loops = []
    import tvm_ffi
    tvm_ffi.structural_walk(scheduled["take_backward_add"].body, [
        (tvm.tirx.For, lambda l: loops.append(l) if l.thread_binding is not None else None)])
    assert len(loops) == 4
    if shutil.which("nvcc"):
        from tvm.support import nvcc
        executable = build.compile_step(_tied("bfloat16"), passes=[AddLookupGradient()],
                                        target=target, cache_dir=tmp_path).executable
        found, todo = [], [executable.mod]
        while todo:
            found.append(todo.pop())
            todo.extend(found[-1].imports)
        source = next(m for m in found if m.kind == "cuda").inspect_source()
        assert "take_backward_add_kernel" in source
        with target:
            assert len(nvcc.compile_cuda(source, target_format="cubin",
                                         compiler=cuda_compiler())) > 1000


def test_a_16_bit_table_is_left_alone():
    """A bf16 table's rows would be added onto the dense gradient in 16 bits one by one, a
    rounding take_backward + add do not make: left to TVM's two ops."""
    table = relax.Var("W", relax.TensorType((VOCAB, DIM), "bfloat16"))
    dense = relax.Var("dW", relax.TensorType((VOCAB, DIM), "bfloat16"))
    dy = relax.Var("dy", relax.TensorType((TOKENS, DIM), "bfloat16"))
    ids = relax.Var("ids", relax.TensorType((TOKENS,), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [table, dense, dy, ids]):
        with bb.dataflow():
            rows = bb.emit(op.grad.take_backward(dy, table, ids, axis=0))
            out = bb.emit_output(op.add(dense, rows))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(AddLookupGradient()(mod), mod)


def test_a_tied_step_split_by_overlapped_collectives_stays_well_formed():
    """Under data parallelism with overlap the backward is split into blocks around the
    gradients' collectives; the kernel reads only what its block can see (a widening's
    16-bit source from an earlier block is not folded in), and the step is well formed."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import raf_dist
    from hf import LogitsOnly, import_transformers
    from raf_dist.compiler.step_passes import nonfinite_guard, step_passes
    from raf_dist.training import build_train_step

    transformers = import_transformers()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    module = LogitsOnly(transformers.GPT2LMHeadModel(config))
    x = torch.randint(0, 64, (2, 16))
    for compute_dtype in (None, "bfloat16"):
        mod, _ = build_train_step(raf_dist.frontend.from_pytorch(module, (x,)), "cross_entropy",
                                  raf_dist.optim.AdamW(lr=1e-3), compute_dtype=compute_dtype,
                                  nonfinite_guard=nonfinite_guard(0, 2), loss_weight=True)
        for p in step_passes(0, 2, 4096, overlap=True):
            mod = p(mod)
        assert relax.analysis.check_well_formed(mod), compute_dtype
        assert len(mod["train_step"].body.blocks) > 1  # the collectives split it
        assert "take_backward_add" in [gv.name_hint for gv in mod.get_global_vars()]
