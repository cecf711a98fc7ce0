"""The fused cross-entropy (training/cross_entropy.py): the loss and the logits' gradient
against PyTorch, in float32 and on bfloat16 logits, through raf_dist's CPU schedule (strict:
a kernel left serial fails the test; the GPU schedule of its kernels: test_schedule_gpu.py);
the loss reading the head's 16-bit logits; and a bf16 training step that never holds a
float32 copy of the logits or of their gradient."""
import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax, tirx

from raf_dist.compiler import build
from raf_dist.compiler.schedule_cpu import ScheduleCPU
from raf_dist.training.cross_entropy import (CROSS_ENTROPY, CROSS_ENTROPY_GRAD, cross_entropy,
                                             narrow_loss_input)
from raf_dist.training.loss import build_loss

def _ops(func):
    names = []
    relax.analysis.post_order_visit(func, lambda e: names.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return names


def _loss_and_gradient(shape, dtype, tmp_path):
    """The compiled (loss, d loss / d logits) of build_loss's cross-entropy on ``shape``
    logits of ``dtype``, built by raf_dist's compiler (ScheduleCPU)."""
    func, _ = build_loss("cross_entropy", shape, dtype)
    mod = tvm.IRModule({tvm.ir.GlobalVar("main"): func.with_attr("global_symbol", "main")})
    mod = relax.transform.Gradient("main")(mod)
    mod = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint == "main_adjoint"})
    step = build.compile_step(mod, cache_dir=tmp_path / "cache")
    vm = relax.VirtualMachine(step.executable, tvm.cpu())
    return vm["main_adjoint"]


def _torch_reference(x, t, dtype):
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(xt.reshape(-1, x.shape[-1]),
                                             torch.tensor(t).reshape(-1))
    loss.backward()
    return loss.detach().numpy(), xt.grad.numpy()


def test_the_loss_is_one_op_and_its_gradient_one_more():
    func, _ = build_loss("cross_entropy", (4, 3, 10), "float32")
    assert _ops(func) == [CROSS_ENTROPY]  # no reshape, no log_softmax, no nll_loss
    mod = tvm.IRModule({tvm.ir.GlobalVar("main"): func.with_attr("global_symbol", "main")})
    adjoint = relax.transform.Gradient("main")(mod)["main_adjoint"]
    assert CROSS_ENTROPY_GRAD in _ops(adjoint)
    assert not {"relax.nn.log_softmax", "relax.grad.nll_loss_backward"} & set(_ops(adjoint))


# (32, 1001): a long row the vector lanes do not divide (GPT-2's 50257 classes), padded for
# the statistics and row-fused (test_odd_long_rows_are_row_fused_kernels)
@pytest.mark.parametrize("shape", [(64, 1000), (4, 16, 257), (32, 1001)])
def test_float32_loss_and_gradient_match_pytorch(shape, tmp_path):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 4).astype("float32")
    t = rng.integers(0, shape[-1], shape[:-1]).astype("int64")
    loss, (grad, _) = _loss_and_gradient(shape, "float32", tmp_path)(
        tvm.runtime.tensor(x), tvm.runtime.tensor(t))
    ref_loss, ref_grad = _torch_reference(x, t, torch.float64)
    loss32, grad32 = _torch_reference(x, t, torch.float32)
    # calibrated: PyTorch's own float32 result against its float64 one on the same logits
    # (loss ~2e-7 relative, gradient ~1e-10 absolute here); 4x that spread, with a floor of
    # a few float32 ulps of the values compared
    loss_tol = 4 * abs(float(loss32) - float(ref_loss)) + 4 * np.finfo(np.float32).eps * abs(
        float(ref_loss))
    grad_tol = 4 * np.abs(grad32 - ref_grad).max() + 4 * np.finfo(np.float32).eps * np.abs(
        ref_grad).max()
    assert abs(float(loss.numpy()) - float(ref_loss)) <= loss_tol
    assert np.abs(grad.numpy() - ref_grad).max() <= grad_tol


# (16, 64, 512): the rows of bench/step_time.py's GPT, whose loss kernel TVM's compute_at once
# refused (a data-dependent read of the widened logits), leaving it serial: strict mode fails
@pytest.mark.parametrize("shape", [(128, 512), (16, 64, 512), (16, 1001)])
def test_bfloat16_logits_give_a_bfloat16_gradient_with_float32_statistics(shape, tmp_path):
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.standard_normal(shape) * 4, dtype=torch.bfloat16)
    t = rng.integers(0, shape[-1], shape[:-1]).astype("int64")
    fn = _loss_and_gradient(shape, "bfloat16", tmp_path)
    x_tvm = tvm.runtime.from_dlpack(x)
    loss, (grad, _) = fn(x_tvm, tvm.runtime.tensor(t))
    assert grad.dtype == "bfloat16"
    ref_loss, ref_grad = _torch_reference(x.float().numpy(), t, torch.float64)
    # the statistics are float32 over bf16 inputs: the loss as float32 arithmetic gives it
    # (the same float32 tolerance as above); the gradient is rounded once to bfloat16 (8
    # significant bits: relative 2^-8 of each element, plus float32 noise far below it)
    assert abs(float(loss.numpy()) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    got = torch.from_dlpack(grad).float().numpy()
    np.testing.assert_allclose(got, ref_grad, rtol=2.0 ** -8, atol=1e-9)


def _loss_of(logits_dtype, second_reader=False):
    bb = relax.BlockBuilder()
    h = relax.Var("h", relax.TensorType((8, 16), logits_dtype))
    t = relax.Var("target", relax.TensorType((8,), "int64"))
    with bb.function("main", [h, t]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(h, "float32")) if logits_dtype != "float32" else h
            out = bb.emit(wide)  # AppendLoss binds the forward's output to a var
            loss = bb.emit(cross_entropy(out, t))
            outputs = [loss]
            if second_reader:
                outputs.append(bb.emit(relax.op.sum(wide)))
            result = bb.emit_output(relax.Tuple(outputs) if second_reader else loss)
        bb.emit_func_output(result)
    return bb.get()["main"]


def test_the_loss_reads_the_heads_16_bit_logits():
    narrowed = narrow_loss_input(_loss_of("bfloat16"))
    calls = [b.value for block in narrowed.body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call)]
    assert [c.op.name for c in calls] == [CROSS_ENTROPY]  # the float32 cast is gone
    assert calls[0].args[0].same_as(narrowed.params[0])
    # a cast something else reads stays for it (the loss still reads the 16-bit logits)
    shared = narrow_loss_input(_loss_of("bfloat16", second_reader=True))
    ops = {b.value.op.name: b.value for block in shared.body.blocks for b in block.bindings
           if isinstance(b.value, relax.Call)}
    assert "relax.astype" in ops and ops[CROSS_ENTROPY].args[0].ty.dtype == "bfloat16"
    # float32 logits: nothing to narrow
    plain = _loss_of("float32")
    tvm.ir.assert_structural_equal(narrow_loss_input(plain), plain)


def test_a_bf16_step_holds_no_float32_logits(tmp_path):
    """The 16-bit step's IR: no float32 tensor of the logits' shape anywhere (neither the
    widened logits, nor log-probabilities, nor a float32 gradient narrowed afterwards)."""
    import raf_dist
    from raf_dist.training.step import build_train_step

    vocab, batch, seq = 96, 2, 8
    module = torch.nn.Sequential(torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, 64),
                                 torch.nn.GELU(), torch.nn.Linear(64, vocab))
    x = torch.randint(0, vocab, (batch, seq))
    model = raf_dist.frontend.from_pytorch(module, (x,))
    mod, _ = build_train_step(model, "cross_entropy", raf_dist.optim.AdamW(lr=1e-3),
                              compute_dtype="bfloat16")
    logits_like = []

    def visit(expr):
        ty = getattr(expr, "ty", None)
        if (isinstance(expr, relax.Var) and isinstance(ty, relax.TensorType)
                and ty.shape is not None and [int(d) for d in ty.shape] in (
                    [batch, seq, vocab], [batch * seq, vocab])):
            logits_like.append(str(ty.dtype))

    relax.analysis.post_order_visit(mod["train_step"], visit)
    assert logits_like and set(logits_like) == {"bfloat16"}


def test_targets_by_row_and_16_bit_weighted_losses_build():
    """(B*T,) targets of (B, T, C) logits are reshaped to the rows; a target of another size
    or dtype is refused naming the shape it needs; a weighted loss on 16-bit predictions
    multiplies its float32 value by the weight (the loss stays float32)."""
    func, (shape, _) = build_loss("cross_entropy", (2, 3, 5), "float32", target_shape=(6,))
    assert shape == (6,) and "relax.reshape" in _ops(func)
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        build_loss("cross_entropy", (2, 3, 5), "float32", target_shape=(5,))
    with pytest.raises(ValueError, match="integer class indices"):
        build_loss("cross_entropy", (2, 5), "float32", target_dtype="float32")
    weighted, _ = build_loss("cross_entropy", (4, 5), "bfloat16", weighted=True)
    assert weighted.ret_ty.dtype == "float32"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_odd_long_rows_are_row_fused_kernels(dtype):
    """Rows of 1001 classes: the loss and its gradient each one parallel loop over the rows
    with every block inside it (their intermediates a row each, not logits-sized), the
    statistics' reductions in vector lanes over the padded row, the gradient's own row split
    into vectors (the last predicated)."""
    func, _ = build_loss("cross_entropy", (64, 1001), dtype)
    mod = tvm.IRModule({tvm.ir.GlobalVar("main"): func.with_attr("global_symbol", "main")})
    mod = relax.transform.Gradient("main")(mod)
    with tvm.target.Target("llvm"):
        mod = tvm.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
            relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    scheduled = ScheduleCPU(strict=True)(mod)
    kernels = {gv.name_hint: f for gv, f in scheduled.functions_items()
               if gv.name_hint.startswith("cross_entropy")}
    assert set(kernels) == {"cross_entropy_rows", "cross_entropy_grad"}
    for name, kernel in kernels.items():
        loops = []
        tvm_ffi.structural_walk(kernel.body, [(tirx.For, loops.append)])
        parallel = [loop for loop in loops if loop.kind == tirx.ForKind.PARALLEL]
        assert [int(loop.extent) for loop in parallel] == [64], name
        inside, everywhere = set(), set()
        tvm_ffi.structural_walk(parallel[0].body, [(tvm.s_tir.SBlock, lambda b: inside.add(
            b.name_hint))])
        tvm_ffi.structural_walk(kernel.body, [(tvm.s_tir.SBlock, lambda b: everywhere.add(
            b.name_hint))])
        assert everywhere - {"root"} == inside, name
        vectorised = [loop for loop in loops if loop.kind == tirx.ForKind.VECTORIZED]
        assert len(vectorised) >= (5 if name == "cross_entropy_grad" else 4), name
