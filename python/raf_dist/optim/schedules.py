"""Learning-rate schedules for ``Trainer(lr_schedule=f)`` (DESIGN.md section 1,
"Training-loop essentials").

A schedule is any callable ``f(k) -> float``: the multiplier of every group's learning rate
for the k-th optimizer update (k = 0 first), as ``torch.optim.lr_scheduler.LambdaLR``
stepped once after each update. A step the non-finite guard skipped is not an update: it
does not advance k. The learning rate stays a runtime scalar of the compiled step (the
optimizer's hypers, computed on the host in float64), so a schedule never recompiles.

The ready-made ones are those of ``transformers.optimization``
(``get_cosine_schedule_with_warmup``, ``get_linear_schedule_with_warmup``,
``get_constant_schedule``): the same multipliers at every k, with an optional floor
``min_ratio`` (nanoGPT and torchtitan decay to a fraction of the peak, not to 0).
"""
import math
import numbers
from typing import Callable

Schedule = Callable[[int], float]


def _check(warmup_steps: int, total_steps: int, min_ratio: float) -> None:
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must not exceed total_steps "
                         f"({total_steps})")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio!r}")


def _warmup(k: int, warmup_steps: int) -> float:
    """k / warmup_steps: 0 at the first update, as transformers' schedules."""
    return float(k) / float(max(1, warmup_steps))


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Schedule:
    """Linear warm-up from 0 over ``warmup_steps`` updates, then half a cosine from 1 down to
    ``min_ratio`` at ``total_steps`` (and ``min_ratio`` after)."""
    _check(warmup_steps, total_steps, min_ratio)

    def f(k: int) -> float:
        if k < warmup_steps:
            return _warmup(k, warmup_steps)
        progress = min(1.0, float(k - warmup_steps) / float(max(1, total_steps - warmup_steps)))
        cosine = max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return min_ratio + (1.0 - min_ratio) * cosine

    return f


def warmup_linear(warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Schedule:
    """Linear warm-up from 0 over ``warmup_steps`` updates, then a straight line from 1 down
    to ``min_ratio`` at ``total_steps`` (and ``min_ratio`` after)."""
    _check(warmup_steps, total_steps, min_ratio)

    def f(k: int) -> float:
        if k < warmup_steps:
            return _warmup(k, warmup_steps)
        left = max(0.0, float(total_steps - k) / float(max(1, total_steps - warmup_steps)))
        return min_ratio + (1.0 - min_ratio) * left

    return f


def constant(warmup_steps: int = 0) -> Schedule:
    """1 throughout, after an optional linear warm-up from 0."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")

    def f(k: int) -> float:
        return _warmup(k, warmup_steps) if k < warmup_steps else 1.0

    return f


def multiplier(schedule: Schedule, k: int) -> float:
    """``schedule(k)`` checked: a finite number >= 0 (a schedule that returns anything else
    is a bug in the user's callable, named here rather than as a NaN parameter later)."""
    value = schedule(k)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(
            value) or value < 0:
        raise ValueError(f"lr_schedule({k}) returned {value!r}; a schedule must return a "
                         "finite number >= 0 (the multiplier of the learning rate)")
    return float(value)
