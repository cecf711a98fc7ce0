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
    _check_against_pytorch(name, opt_name)


# Adagrad with every option set (lr_decay, weight decay, an initial accumulator) against
# torch.optim.Adagrad; row-wise Adagrad against torchrec's update rule (tests/models.py) on the
# transformer (an embedding table, 2-D weights, 1-D biases and norms)
@pytest.mark.parametrize("name, opt_name", [("cnn", "adagrad"),
                                            ("transformer", "rowwise_adagrad")])
def test_adagrad_matches_pytorch(name, opt_name):
    _, _, trainer = _check_against_pytorch(name, opt_name)
    states = trainer.optimizer_state_dict()
    for param, value in trainer.state_dict().items():
        expected = value.shape
        if opt_name == "rowwise_adagrad" and value.ndim >= 2:  # one accumulator per row
            expected = (value.shape[0],) + (1,) * (value.ndim - 1)
        assert states[param]["sum"].shape == expected, param


def _check_against_pytorch(name, opt_name):
    losses, params, trainer = run_raf(name, opt_name, 8, STEPS)
    ref_losses, ref_params = torch_reference(name, opt_name, 8, STEPS)
    assert rel_err(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert sorted(params) == sorted(ref_params)
    for key in ref_params:
        assert params[key].shape == ref_params[key].shape
        assert rel_err(params[key], ref_params[key]) <= TOL, key
    return losses, params, trainer


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


def test_dropout_with_seeded_masks_matches_pytorch():
    """Dropout is captured from the training graph; given the masks the Trainer drew (seeded),
    PyTorch's hooks apply the same masks, and training agrees; inference has no dropout."""
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                 torch.nn.Linear(16, 4), torch.nn.Dropout(0.1))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    assert [(shape, rate) for shape, _, rate in model.dropout_specs] == [((6, 16), 0.3), ((6, 4), 0.1)]
    trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.Adam(lr=1e-2), seed=7)
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    drops = [m for m in module.modules() if isinstance(m, torch.nn.Dropout)]
    for step in range(1, STEPS + 1):
        masks = trainer.dropout_masks(step)
        assert all(set(np.unique(m)) <= {0.0, np.float32(1 / (1 - r))}
                   for m, (_, _, r) in zip(masks, model.dropout_specs))
        hooks = [d.register_forward_hook(lambda mod, inp, out, mask=torch.tensor(m): inp[0] * mask)
                 for d, m in zip(drops, masks)]
        loss = trainer.step(x.numpy(), y.numpy())
        opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(module(x), y)
        ref.backward()
        opt.step()
        for hook in hooks:
            hook.remove()
        assert abs(loss - ref.item()) <= TOL * abs(ref.item())
    for name, p in module.named_parameters():
        assert rel_err(trainer.state_dict()[name], p.detach().numpy()) <= TOL, name
    assert not np.array_equal(trainer.dropout_masks(1)[0], trainer.dropout_masks(2)[0])
    np.testing.assert_array_equal(trainer.dropout_masks(3)[1], trainer.dropout_masks(3)[1])
    module.eval()
    np.testing.assert_allclose(trainer.predict(x.numpy()), module(x).detach().numpy(), rtol=1e-5,
                               atol=1e-6)
