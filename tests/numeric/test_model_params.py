"""Real models' parameters as they are: tied weights (one parameter used twice, as GPT-2's head
and token embedding), frozen parameters (requires_grad=False), cross-entropy targets checked
before the step, and non-finite losses or gradients that never silently change the weights.
One process; the 2-rank version of the tied model is tests/distributed/test_model_params.py."""
import logging
import math

import numpy as np
import pytest
import torch

import raf_dist
from models import make, rel_err, torch_loss, torch_step

STEPS = 3
# float32, 3 AdamW steps: raf_dist and PyTorch sum the tied weight's two gradient
# contributions (embedding scatter-add, head matmul) and every reduction in another order,
# ~1e-7 relative per op; Adam's normalisation keeps that at the same relative size in the
# update, so 1e-5 leaves two orders of magnitude of margin and still catches a gradient that
# misses either use of the tied weight (an error of tens of percent).
TOL = 1e-5


def _trainer(module, x, optimizer=None, **kwargs):
    model = raf_dist.frontend.from_pytorch(module, (x,))
    return raf_dist.Trainer(model, optimizer=optimizer or raf_dist.optim.AdamW(lr=1e-2),
                            **kwargs)


def _torch_steps(module, x, y, steps):
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    return [torch_step(module, opt, x, y) for _ in range(steps)]


@pytest.fixture(scope="module")
def tied_run():
    """The tied model trained STEPS AdamW steps by raf_dist: (trainer, x, y, losses)."""
    module, x, y = make("tied", 4)
    trainer = _trainer(module, x)
    losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(STEPS)]
    return trainer, x, y, losses


def test_tied_weights_are_one_parameter_trained_like_pytorch(tied_run):
    trainer, x, y, losses = tied_run
    module, _, _ = make("tied", 4)
    assert module.head.weight is module.tok.weight
    ref_losses = _torch_steps(module, x, y, STEPS)
    assert rel_err(losses, ref_losses) <= TOL, (losses, ref_losses)
    params = trainer.state_dict()
    for name, value in module.named_parameters():
        assert rel_err(params[name], value.detach().numpy()) <= TOL, name
    # held, updated and given optimizer state once
    assert trainer.signature.param_names.count("tok.weight") == 1
    assert list(trainer.optimizer_state_dict()) == [n for n, _ in module.named_parameters()]


def test_tied_state_dict_keys_are_named_parameters(tied_run):
    trainer = tied_run[0]
    module, _, _ = make("tied", 4)
    params = trainer.state_dict()
    assert list(params) == [n for n, _ in module.named_parameters()]
    assert "head.weight" not in params
    assert trainer.model.tied_params == {"head.weight": "tok.weight"}


def test_tied_checkpoint_consolidates_into_a_strict_torch_load(tied_run, tmp_path):
    """consolidate writes every name of the tied weight (torch's state_dict lists both), so
    load_state_dict(strict=True) accepts it, and the loaded module computes what predict
    does."""
    from safetensors.torch import load_file

    from raf_dist.tools.consolidate import consolidate

    trainer, x, _, _ = tied_run
    trainer.save_checkpoint(tmp_path / "ckpt")
    consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    module, _, _ = make("tied", 4, seed=7)  # other initial values
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(tensors) == sorted(module.state_dict())
    module.load_state_dict(tensors, strict=True)
    assert module.head.weight is module.tok.weight
    with torch.no_grad():
        expected = module(x).numpy()
    np.testing.assert_allclose(trainer.predict(x.numpy()), expected, rtol=1e-5, atol=1e-6)
    # the trainer's own state dict, plus the aliases, loads strictly too
    full = {n: torch.from_numpy(v) for n, v in trainer.state_dict().items()}
    full.update({a: full[n] for a, n in trainer.model.tied_params.items()})
    module.load_state_dict(full, strict=True)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_tied_zero_world_of_one_equals_plain(tied_run, dist_config, level):
    trainer, x, y, ref_losses = tied_run
    module, _, _ = make("tied", 4)
    dist_config.update({"enable_data_parallel": True, "zero_opt_level": level,
                        "bucket_size_mb": 0.0005})
    zero = _trainer(module, x)
    losses = [zero.step(x.numpy(), y.numpy()) for _ in range(STEPS)]
    params = zero.state_dict()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert list(params) == list(trainer.state_dict())
    for name, value in trainer.state_dict().items():
        np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-7)


def test_frozen_parameter_is_not_trained():
    module, x, y = make("mlp", 8)
    module.layers[0].weight.requires_grad_(False)
    frozen = module.layers[0].weight.detach().numpy().copy()
    trainer = _trainer(module, x)
    assert trainer.model.frozen_params == ["layers.0.weight"]
    losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(STEPS)]
    ref_losses = _torch_steps(module, x, y, STEPS)
    assert rel_err(losses, ref_losses) <= TOL
    params = trainer.state_dict()
    assert list(params) == [n for n, _ in module.named_parameters()]
    np.testing.assert_array_equal(params["layers.0.weight"], frozen)
    for name, value in module.named_parameters():
        assert rel_err(params[name], value.detach().numpy()) <= TOL, name
    # no gradient, optimizer state or communication for it: it is not a trained parameter
    assert "layers.0.weight" not in trainer.optimizer_state_dict()
    assert "layers.0.weight" not in trainer.signature.param_names
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    stats = trainer.stats()
    assert stats["optimizer_state_bytes"] == 2 * 4 * trained  # exp_avg, exp_avg_sq
    assert stats["grad_bytes"] == 4 * trained


def test_frozen_parameter_under_zero_is_not_sharded(dist_config):
    module, x, y = make("mlp", 8)
    module.layers[1].bias.requires_grad_(False)
    dist_config.update({"enable_data_parallel": True, "zero_opt_level": 3,
                        "bucket_size_mb": 0.001})
    trainer = _trainer(module, x)
    losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(2)]
    params = trainer.state_dict()
    assert rel_err(losses, _torch_steps(module, x, y, 2)) <= TOL
    # the gradient buckets (and ZeRO's shards) hold the trained parameters only
    assert "layers.1.bias" not in trainer.signature.param_names
    bucketed = sorted(k for bucket in trainer.grad_buckets for k in bucket)
    assert bucketed == list(range(len(trainer.signature.param_names)))
    np.testing.assert_array_equal(params["layers.1.bias"], module.layers[1].bias.detach().numpy())


@pytest.mark.parametrize("bad", [5, -1])
def test_cross_entropy_targets_out_of_range_raise_before_the_step(bad):
    module, x, y = make("mlp", 8)
    trainer = _trainer(module, x)
    before = trainer.state_dict()
    y = y.numpy().copy()
    y[3] = bad
    with pytest.raises(ValueError, match=rf"target {bad} is outside \[0, 5\)"):
        trainer.step(x.numpy(), y)
    assert trainer.step_count == 0
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(value, before[name])


def _nan_batch(x):
    bad = x.numpy().copy()
    bad[0, 0] = np.nan
    return bad


def test_nan_input_raises_with_the_step_number_and_leaves_parameters_unchanged():
    module, x, y = make("mlp", 8)
    trainer = _trainer(module, x)
    trainer.step(x.numpy(), y.numpy())
    params, states = trainer.state_dict(), trainer.optimizer_state_dict()
    with pytest.raises(FloatingPointError, match="step 2"):
        trainer.step(_nan_batch(x), y.numpy())
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(value, params[name])
    for name, by_state in trainer.optimizer_state_dict().items():
        for state, value in by_state.items():
            np.testing.assert_array_equal(value, states[name][state])
    assert trainer.step_count == 1


def test_skip_mode_skips_the_update_and_warns(caplog):
    """A skipped step changes nothing, Adam's step count included: good, NaN (skipped), good
    ends where good, good does."""
    module, x, y = make("mlp", 8)
    skipping = _trainer(module, x, nonfinite="skip")
    plain = _trainer(module, x)
    skipping.step(x.numpy(), y.numpy())
    with caplog.at_level(logging.WARNING, logger="raf_dist"):
        loss = skipping.step(_nan_batch(x), y.numpy())
    assert math.isnan(loss)
    assert any("step 2" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    skipping.step(x.numpy(), y.numpy())
    plain.step(x.numpy(), y.numpy())
    plain.step(x.numpy(), y.numpy())
    for name, value in plain.state_dict().items():
        np.testing.assert_array_equal(skipping.state_dict()[name], value)
    assert skipping.skipped_steps == 1 and skipping.step_count == 3


def test_nan_reaches_the_loss_through_relu():
    """The root cause: relu(NaN) was 0 in generated code, so the loss stayed finite while the
    first layer's weight gradient was NaN. Now the loss itself is NaN, as in PyTorch."""
    module, x, y = make("mlp", 8)
    trainer = _trainer(module, x, nonfinite="skip")
    with torch.no_grad():
        assert math.isnan(torch_loss(module(torch.from_numpy(_nan_batch(x))), y).item())
    assert math.isnan(trainer.step(_nan_batch(x), y.numpy()))
    assert np.isnan(trainer.predict(_nan_batch(x))[0]).all()


@pytest.mark.parametrize("level", [1, 2, 3])
def test_skip_mode_under_zero_leaves_parameters_and_state_as_they_were(dist_config, level):
    """ShardZeRO's guard (nonfinite="skip"): no bucket is updated until every gradient is
    known finite; good, NaN (skipped), good ends where good, good does, at every level."""
    module, x, y = make("mlp", 8)
    dist_config.update({"enable_data_parallel": True, "zero_opt_level": level,
                        "bucket_size_mb": 0.001})  # several buckets
    skipping = _trainer(module, x, nonfinite="skip")
    plain = _trainer(module, x)
    assert skipping.update_guarded and not plain.update_guarded
    skipping.step(x.numpy(), y.numpy())
    assert math.isnan(skipping.step(_nan_batch(x), y.numpy()))
    skipping.step(x.numpy(), y.numpy())
    plain.step(x.numpy(), y.numpy())
    plain.step(x.numpy(), y.numpy())
    for name, value in plain.state_dict().items():
        np.testing.assert_allclose(skipping.state_dict()[name], value, rtol=1e-6, atol=0)
    for name, by_state in plain.optimizer_state_dict().items():
        for state, value in by_state.items():
            np.testing.assert_allclose(skipping.optimizer_state_dict()[name][state], value,
                                       rtol=1e-6, atol=0)
    assert skipping.skipped_steps == 1 and skipping.step_count == 3