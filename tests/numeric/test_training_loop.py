"""Numeric tier for the training loop's essentials (DESIGN.md section 1): learning-rate
schedules equal transformers' own and ``torch.optim.lr_scheduler.LambdaLR`` on a real run,
through a skipped non-finite step and a checkpoint resume."""
import logging
import math

import numpy as np
import pytest
import torch

import raf_dist
from raf_dist.optim import schedules
from models import make, raf_optimizer, rel_err, torch_loss, torch_optimizer

# float32 sums in another order per step: ~1e-7 each; ten steps stay far below 1e-5
TOL = 1e-5


@pytest.mark.parametrize("warmup,total", [(0, 7), (3, 10), (10, 10)])
def test_schedules_equal_transformers(warmup, total):
    """The multipliers of every update k in [0, total] are transformers'."""
    from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                              get_linear_schedule_with_warmup)

    cases = [(schedules.warmup_cosine(warmup, total), get_cosine_schedule_with_warmup,
              (warmup, total)),
             (schedules.warmup_linear(warmup, total), get_linear_schedule_with_warmup,
              (warmup, total)),
             (schedules.constant(warmup), get_constant_schedule_with_warmup, (warmup,))]
    for ours, make_theirs, args in cases:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        theirs = make_theirs(opt, *args)
        for k in range(total + 1):
            assert math.isclose(ours(k), opt.param_groups[0]["lr"], abs_tol=1e-12), (
                make_theirs.__name__, k)
            opt.step()
            theirs.step()


def test_schedule_floor_and_bad_arguments():
    f = schedules.warmup_cosine(2, 10, min_ratio=0.1)
    assert f(0) == 0.0 and f(2) == 1.0 and math.isclose(f(10), 0.1) and math.isclose(f(50), 0.1)
    assert math.isclose(schedules.warmup_linear(0, 4, min_ratio=0.5)(2), 0.75)
    with pytest.raises(ValueError, match="warmup_steps .* must not exceed total_steps"):
        schedules.warmup_cosine(5, 4)
    with pytest.raises(ValueError, match=r"min_ratio must be in \[0, 1\]"):
        schedules.warmup_linear(0, 4, min_ratio=2.0)
    module, x, _ = make("mlp", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    with pytest.raises(TypeError, match="lr_schedule must be a callable"):
        raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), lr_schedule=0.5)


def test_lr_schedule_equals_lambda_lr_through_a_skip_and_a_resume(tmp_path):
    """AdamW (its decoupled decay reads the lr too) under warm-up + cosine: 10 updates equal
    PyTorch's AdamW + LambdaLR. A NaN batch after the third update is skipped and does not
    advance the schedule; the run is saved after the fifth update and a fresh Trainer resumes
    it (the schedule's position comes from the checkpoint's step counts)."""
    schedule = schedules.warmup_cosine(3, 10, min_ratio=0.1)
    module, x, y = make("mlp", 8)
    torch_module = make("mlp", 8)[0]
    opt = torch_optimizer("adamw", torch_module.parameters())
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref_losses, ref_lrs = [], []
    for _ in range(10):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(torch_module(x), y)
        loss.backward()
        ref_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        lambda_lr.step()
        ref_losses.append(loss.item())

    model = raf_dist.frontend.from_pytorch(module, (x,))

    def trainer():
        return raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), lr_schedule=schedule,
                                nonfinite="skip")

    first = trainer()
    assert first.last_lr == ref_lrs[0] == 0.0  # warm-up starts at 0, as LambdaLR's
    losses, lrs = [], []
    for k in range(5):
        if k == 3:
            bad = x.numpy().copy()
            bad[0, 0] = np.nan
            assert math.isnan(first.step(bad, y.numpy()))
            assert first.last_lr == ref_lrs[3]  # the lr it would have used; not advanced
        losses.append(first.step(x.numpy(), y.numpy()))
        lrs.append(first.last_lr)
    assert first.skipped_steps == 1 and first.step_count == 6
    first.save_checkpoint(tmp_path)
    second = trainer()
    second.load_checkpoint(tmp_path)
    assert (second.step_count, second.skipped_steps) == (6, 1)
    for _ in range(5):
        losses.append(second.step(x.numpy(), y.numpy()))
        lrs.append(second.last_lr)
    assert np.allclose(lrs, ref_lrs, rtol=1e-12, atol=0), (lrs, ref_lrs)
    assert rel_err(losses, ref_losses) <= TOL, (losses, ref_losses)
    for name, p in torch_module.named_parameters():
        assert rel_err(second.state_dict()[name], p.detach().numpy()) <= TOL, name


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_metrics_count_the_flops_pytorch_counts(name, caplog):
    """metrics(): the step's FLOPs equal torch.utils.flop_counter's count of the same forward
    and backward (matmuls and convolutions), rates are positive, MFU in (0, 1]; log_every
    logs them on the raf_dist logger."""
    from torch.utils.flop_counter import FlopCounterMode

    module, x, y = make(name, 8)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_optimizer("adamw"), log_every=2)
    assert trainer.metrics() == {}
    counter = FlopCounterMode(display=False)
    with counter:
        torch_loss(module(x), y).backward()
    with caplog.at_level(logging.INFO, logger="raf_dist"):
        for _ in range(2):
            loss = trainer.step(x.numpy(), y.numpy())
    assert any(r.getMessage().startswith("step 2: loss ") and "mfu" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    m = trainer.metrics()
    assert m["step"] == 2 and m["loss"] == loss and m["lr"] == raf_optimizer("adamw").lr
    assert m["flops_per_step"] == counter.get_total_flops(), (m, counter.get_total_flops())
    assert m["step_time_s"] > 0 and m["rows_per_s"] == pytest.approx(8 / m["step_time_s"])
    assert 0 < m["mfu"] <= 1 and m["flops_per_s"] > 0 and m["grad_norm"] is None


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum", "adagrad"])
def test_param_groups_equal_torch_param_groups(opt_name, tmp_path):
    """Biases without weight decay, the first layer with its own lr (and betas / momentum /
    Adagrad's lr_decay): 4 steps equal torch.optim with the same param groups; a
    parameter no pattern matches takes the constructor's values. The groups' patterns are
    saved in a checkpoint, and one trained with other groups is refused on load."""
    own = {"adamw": {"betas": (0.8, 0.99)}, "sgd_momentum": {"momentum": 0.5},
           "adagrad": {"lr_decay": 0.1}}[opt_name]
    groups = [{"params": ["*.bias"], "weight_decay": 0.0},
              {"params": ["layers.0.*"], "lr": 1e-3, **own}]
    module, x, y = make("mlp", 8)
    torch_module = make("mlp", 8)[0]
    named = dict(torch_module.named_parameters())
    first_layer = [n for n in named if n.startswith("layers.0.") and not n.endswith(".bias")]
    torch_groups = [{**groups[0], "params": [named[n] for n in named if n.endswith(".bias")]},
                    {**groups[1], "params": [named[n] for n in first_layer]},
                    {"params": [named[n] for n in named
                                if not n.endswith(".bias") and n not in first_layer]}]
    if opt_name == "adamw":
        opt = torch.optim.AdamW(torch_groups, lr=1e-2, weight_decay=0.1)
        ours = raf_dist.optim.AdamW(lr=1e-2, weight_decay=0.1, param_groups=groups)
    elif opt_name == "adagrad":
        opt = torch.optim.Adagrad(torch_groups, lr=0.05, weight_decay=1e-2,
                                  initial_accumulator_value=0.1)
        ours = raf_dist.optim.Adagrad(lr=0.05, weight_decay=1e-2, initial_accumulator_value=0.1,
                                      param_groups=groups)
        # torch.optim.Adagrad fills every accumulator from the constructor's value and
        # ignores a group's: refused here rather than ignored
        with pytest.raises(ValueError, match="reads from the constructor only"):
            raf_dist.optim.Adagrad(param_groups=[{"params": ["*.bias"],
                                                  "initial_accumulator_value": 0.5}])
    else:
        opt = torch.optim.SGD(torch_groups, lr=0.05, momentum=0.9, weight_decay=1e-2)
        ours = raf_dist.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-2, param_groups=groups)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    trainer = raf_dist.Trainer(model, optimizer=ours)
    losses, ref = [], []
    for _ in range(4):
        losses.append(trainer.step(x.numpy(), y.numpy()))
        opt.zero_grad()
        loss = torch_loss(torch_module(x), y)
        loss.backward()
        opt.step()
        ref.append(loss.item())
    assert rel_err(losses, ref) <= TOL, (losses, ref)
    for name, p in named.items():
        assert rel_err(trainer.state_dict()[name], p.detach().numpy()) <= TOL, name
    trainer.save_checkpoint(tmp_path)
    regrouped = [{"params": ["*.weight"], "weight_decay": 0.0}]
    other = raf_dist.Trainer(model, optimizer={
        "adamw": lambda: raf_dist.optim.AdamW(lr=1e-2, param_groups=regrouped),
        "adagrad": lambda: raf_dist.optim.Adagrad(lr=0.05, param_groups=regrouped),
        "sgd_momentum": lambda: raf_dist.optim.SGD(lr=0.05, momentum=0.9,
                                                   param_groups=regrouped)}[opt_name]())
    with pytest.raises(raf_dist.checkpoint.CheckpointError, match="param_groups"):
        other.load_checkpoint(tmp_path)


def test_bad_param_groups_are_refused_naming_the_problem():
    module, x, _ = make("mlp", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    with pytest.raises(ValueError, match=r"param_groups\[1\] pattern 'decoder\.\*' matches no"):
        raf_dist.Trainer(model, optimizer=raf_dist.optim.AdamW(param_groups=[
            {"params": ["*.bias"], "weight_decay": 0.0}, {"params": ["decoder.*"]}]))
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets \['momentum'\]"):
        raf_dist.Trainer(model, optimizer=raf_dist.optim.AdamW(param_groups=[
            {"params": ["*.bias"], "momentum": 0.9}]))
    with pytest.raises(ValueError, match="changes the optimizer's state"):
        raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1, param_groups=[
            {"params": ["*.bias"], "momentum": 0.9}]))
    with pytest.raises(ValueError, match="must be a dict with a 'params' list"):
        raf_dist.optim.AdamW(param_groups=[{"lr": 0.1}])


def test_clipping_under_bf16_takes_the_norm_in_float32():
    """precision="bf16" with clipping: the norm is taken in float32 over the float32 master
    gradients, within bf16's rounding of the float32 run's (PyTorch autocast's own distance
    from float32 on this case is ~1e-3), and the step clips."""
    module, x, y = make("transformer", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    norms = {}
    for precision in ("fp32", "bf16"):
        trainer = raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), precision=precision,
                                   max_grad_norm=0.1)
        trainer.step(x.numpy(), y.numpy())
        norms[precision] = trainer.last_grad_norm
    assert norms["fp32"] > 0.1 and abs(norms["bf16"] - norms["fp32"]) <= 0.02 * norms["fp32"], norms
