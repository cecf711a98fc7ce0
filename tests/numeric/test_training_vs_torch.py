"""Numeric tier: single-process training through the IR against PyTorch on the same data.

5 steps of each optimizer on each model; losses and parameters must agree to a
norm-relative 2e-5 (float32 with different reduction orders drifts ~1e-7 per step; 2e-5
leaves room for 5 steps of Adam's division by small second moments)."""
import numpy as np
import pytest

import raf_dist
from models import make, raf_optimizer, torch_reference

STEPS = 5
TOL = 2e-5


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)


def run_raf(name, opt_name, batch, steps):
    module, x, y = make(name, batch)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    trainer = raf_dist.Trainer(model, loss="cross_entropy", optimizer=raf_optimizer(opt_name))
    losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(steps)]
    return losses, trainer.state_dict(), trainer


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adamw"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_matches_pytorch(name, opt_name):
    losses, params, _ = run_raf(name, opt_name, 8, STEPS)
    ref_losses, ref_params = torch_reference(name, opt_name, 8, STEPS)
    assert rel_err(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert sorted(params) == sorted(ref_params)
    for key in ref_params:
        assert params[key].shape == ref_params[key].shape
        assert rel_err(params[key], ref_params[key]) <= TOL, key


@pytest.mark.parametrize("name", ["mha", "sdpa"])
def test_imported_attention_matches_pytorch(name):
    losses, params, _ = run_raf(name, "adamw", 4, STEPS)
    ref_losses, ref_params = torch_reference(name, "adamw", 4, STEPS)
    assert rel_err(losses, ref_losses) <= TOL
    for key in ref_params:
        assert rel_err(params[key], ref_params[key]) <= TOL, key


def test_nesterov_matches_pytorch():
    losses, params, _ = run_raf("mlp", "sgd_nesterov", 8, STEPS)
    ref_losses, ref_params = torch_reference("mlp", "sgd_nesterov", 8, STEPS)
    assert rel_err(losses, ref_losses) <= TOL
    for key in ref_params:
        assert rel_err(params[key], ref_params[key]) <= TOL, key


def test_mse_loss_matches_pytorch():
    import torch

    module, x, _ = make("mlp", 8)
    target = torch.randn(8, 5, generator=torch.Generator().manual_seed(3))
    model = raf_dist.frontend.from_pytorch(module, (x,))
    trainer = raf_dist.Trainer(model, loss="mse", optimizer=raf_dist.optim.SGD(lr=0.1))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(3):
        got = trainer.step(x.numpy(), target.numpy())
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), target)
        loss.backward()
        opt.step()
        assert abs(got - loss.item()) <= TOL * abs(loss.item())
    for name, p in module.named_parameters():
        assert rel_err(trainer.state_dict()[name], p.detach().numpy()) <= TOL


def test_state_dict_names_and_stats():
    module, x, y = make("mlp", 8)
    losses, params, trainer = run_raf("mlp", "adam", 8, 1)
    assert list(params) == [n for n, _ in module.named_parameters()]
    stats = trainer.stats()
    numel = sum(p.numel() for p in module.parameters())
    assert stats["param_bytes"] == 4 * numel
    assert stats["optimizer_state_bytes"] == 8 * numel  # Adam: exp_avg + exp_avg_sq
    assert stats["planned_peak_bytes"] > 0
