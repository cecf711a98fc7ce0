"""Numeric tier: modules with buffers, trained through the IR against PyTorch.

Constant buffers (a causal mask, a scale table) become IR constants; BatchNorm running
statistics are carried between steps and updated as ``module.train()`` does (momentum,
momentum=None, unbiased running variance, num_batches_tracked). Each model trains 3 steps;
losses, every parameter and every buffer must agree with PyTorch to a norm-relative 2e-5:
float32 with another reduction order drifts ~1e-7 per op chain, batch norm divides by the
batch standard deviation (amplifying it by up to ~1/std of the pre-activations, ~10 here) and
Adam's update divides by small second moments; 2e-5 leaves that room over 3 steps while a
wrong formula (biased variance: a factor n/(n-1) >= 1.02 here) fails by orders of magnitude.
"""
import copy

import numpy as np
import pytest
import torch

import raf_dist
from models import (make, raf_optimizer, rel_err, torch_loss, torch_optimizer,
                    torch_step)

STEPS = 3
TOL = 2e-5


def train_both(name, opt_name, batch=8, steps=STEPS):
    module, x, y = make(name, batch)
    reference = copy.deepcopy(module)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    trainer = raf_dist.Trainer(model, loss="cross_entropy", optimizer=raf_optimizer(opt_name))
    opt = torch_optimizer(opt_name, reference.parameters())
    reference.train()
    losses, ref_losses = [], []
    for _ in range(steps):
        losses.append(trainer.step(x.numpy(), y.numpy()))
        ref_losses.append(torch_step(reference, opt, x, y))
    return trainer, reference, x, losses, ref_losses


def assert_same_state(trainer, reference):
    params = trainer.state_dict()
    assert list(params) == [n for n, _ in reference.named_parameters()]
    for name, p in reference.named_parameters():
        assert rel_err(params[name], p.detach().numpy()) <= TOL, name
    buffers = trainer.buffers_dict()
    assert list(buffers) == [n for n, _ in reference.named_buffers()]
    for name, b in reference.named_buffers():
        assert buffers[name].shape == tuple(b.shape) and str(buffers[name].dtype) == str(
            b.dtype).replace("torch.", ""), name
        if b.dtype == torch.int64:  # num_batches_tracked: exact
            assert np.array_equal(buffers[name], b.numpy()), name
        else:
            assert rel_err(buffers[name], b.numpy()) <= TOL, name


@pytest.mark.parametrize("name,opt_name", [
    ("bn_cnn", "adamw"), ("bn_cnn", "sgd_momentum"), ("bn_mlp", "sgd_momentum"),
    ("bn_mlp", "adamw"), ("bn3d", "adamw"), ("causal_mask", "sgd_momentum")])
def test_trains_like_pytorch(name, opt_name):
    trainer, reference, _, losses, ref_losses = train_both(name, opt_name)
    assert rel_err(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert_same_state(trainer, reference)


def test_constant_buffers_are_ir_constants():
    module, x, _ = make("causal_mask", 4)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    assert model.buffer_names == []  # nothing carried, nothing copied per step
    assert sorted(model.constant_buffers) == ["mask", "scale"]
    assert model.non_persistent_buffers == ["mask"]
    n_params = len(list(module.parameters()))
    assert len(model.forward.params) == 1 + n_params  # the input and the parameters only


def test_running_statistics_are_step_state():
    module, x, _ = make("bn_mlp", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    assert model.buffer_names == ["bn1.running_mean", "bn1.running_var",
                                  "bn1.num_batches_tracked", "bn2.running_mean",
                                  "bn2.running_var", "bn2.num_batches_tracked"]
    trainer = raf_dist.Trainer(model, loss="cross_entropy", optimizer=raf_dist.optim.SGD(lr=0.1))
    attrs = trainer.ir["train_step"].attrs
    n_args = len(trainer.ir["train_step"].params)
    updated = [int(i) for i in attrs["raf_dist.updated_arguments"]]
    assert updated[-len(model.buffer_names):] == list(range(n_args - len(model.buffer_names),
                                                            n_args))


@pytest.mark.parametrize("name", ["bn_cnn", "bn3d"])
def test_batch_norm_gradient_matches_autograd(name):
    """Plain SGD with lr=1: each parameter moves by exactly its gradient."""
    module, x, y = make(name, 6)
    before = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    reference = copy.deepcopy(module).train()
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               loss="cross_entropy", optimizer=raf_dist.optim.SGD(lr=1.0))
    trainer.step(x.numpy(), y.numpy())
    torch_loss(reference(x), y).backward()
    after = trainer.state_dict()
    for n, p in reference.named_parameters():
        assert rel_err(before[n] - after[n], p.grad.numpy()) <= TOL, n


@pytest.mark.parametrize("name", ["bn_cnn", "bn_mlp"])
def test_predict_uses_running_statistics(name):
    trainer, reference, x, _, _ = train_both(name, "adamw")
    reference.eval()
    rows = torch.cat([x, x[:3] * 0.5])  # any number of rows (the last piece padded)
    expected = reference(rows).detach().numpy()
    assert rel_err(trainer.predict(rows.numpy()), expected) <= TOL


def test_checkpoint_round_trip_with_buffers(tmp_path):
    from safetensors.torch import load_file

    from raf_dist.tools.consolidate import consolidate

    trainer, reference, x, _, _ = train_both("bn_mlp", "adamw", steps=2)
    _, _, y = make("bn_mlp", 8)
    trainer.save_checkpoint(tmp_path / "ckpt")
    module, _, _ = make("bn_mlp", 8, seed=5)  # other initial values everywhere
    restored = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                loss="cross_entropy", optimizer=raf_optimizer("adamw"))
    restored.load_checkpoint(tmp_path / "ckpt")
    for name, value in trainer.buffers_dict().items():
        assert np.array_equal(restored.buffers_dict()[name], value), name
    # the restored run continues exactly as the original
    assert restored.step(x.numpy(), y.numpy()) == trainer.step(x.numpy(), y.numpy())
    for name, value in trainer.buffers_dict().items():
        assert np.array_equal(restored.buffers_dict()[name], value), name

    trainer.save_checkpoint(tmp_path / "ckpt")
    consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    fresh, _, _ = make("bn_mlp", 8, seed=7)
    fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")))  # strict
    for name, b in fresh.named_buffers():
        assert np.array_equal(b.numpy(), trainer.buffers_dict()[name]), name
    for name, p in fresh.named_parameters():
        assert np.array_equal(p.detach().numpy(), trainer.state_dict()[name]), name


def test_consolidate_leaves_out_non_persistent_buffers(tmp_path):
    from safetensors.torch import load_file

    from raf_dist.tools.consolidate import consolidate

    trainer, _, _, _, _ = train_both("causal_mask", "sgd_momentum", steps=1)
    trainer.save_checkpoint(tmp_path / "ckpt")
    consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "mask" not in tensors and "scale" in tensors
    fresh, _, _ = make("causal_mask", 4, seed=3)
    fresh.load_state_dict(tensors)  # strict: exactly the torch state_dict's keys


def test_sync_batch_norm_rewrite_inserts_allreduce_with_gradient():
    """IR tier: with 2 ranks each batch norm sums its 2 statistics across ranks in forward,
    and autodiff mirrors each allreduce in backward (4 per batch norm in the step)."""
    import tvm
    from tvm import relax

    from raf_dist.passes.batch_norm import decompose_forward
    from raf_dist.training import build_train_step

    module, x, _ = make("bn_cnn", 4)
    model = decompose_forward(raf_dist.frontend.from_pytorch(module, (x,)), sync_world_size=2)
    allreduce = tvm.ir.Op.get("relax.ccl.allreduce")

    def count(func):
        calls = []
        relax.analysis.post_order_visit(
            func, lambda e: calls.append(e) if isinstance(e, relax.Call) and e.op == allreduce
            else None)
        return len(calls)

    assert count(model.forward) == 2
    ir, _ = build_train_step(model, "cross_entropy", raf_dist.optim.SGD(lr=0.1))
    assert count(ir["train_step"]) == 4
