"""The loop's host-side scalars, alike for both executors: which update a step is (steps the
non-finite guard skipped are not updates: Adam's bias correction and the learning-rate
schedule leave them out, as torch.optim and LambdaLR never see them), its learning rate and
the optimizer's hypers for it, the gradient norm and loss scale it reports, what a checkpoint
keeps of them, and ``metrics()``."""
import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..optim import Optimizer, group_hyper_name
from ..optim.schedules import multiplier

_LOG = logging.getLogger("raf_dist")


def update_hypers(groups: Sequence[Optimizer], lr_schedule: Optional[Callable[[int], float]],
                  updates: int) -> Tuple[Dict[str, float], float]:
    """(the hyper values of every parameter group, by step argument name; the learning rate
    of the optimizer's own values, ``groups[0]``) for the update that follows ``updates``
    updates taken (k = ``updates``: 0 first). The schedule multiplies every group's lr."""
    factor = 1.0 if lr_schedule is None else multiplier(lr_schedule, updates)
    values: Dict[str, float] = {}
    for g, group in enumerate(groups):
        for name, value in group.hyper_values(updates + 1, lr=group.lr * factor).items():
            values[group_hyper_name(g, name)] = value
    return values, groups[0].lr * factor


class LoopScalars:
    """The part of an executor's surface made of the loop's scalars. The executor sets
    ``optimizer``, ``lr_schedule``, ``max_grad_norm``, ``step_count``, ``skipped_steps``,
    ``_last_lr`` / ``_last_grad_norm`` (None at first), ``_metrics`` (a
    runtime.metrics.StepMetrics) and, under precision="fp16", ``_scaler``."""

    optimizer: Optimizer
    lr_schedule: Optional[Callable[[int], float]]
    max_grad_norm: Optional[float]
    step_count: int
    skipped_steps: int
    _last_lr: Optional[float]
    _last_grad_norm: Optional[float]
    _metrics: Any
    _scaler: Any = None  # a runtime.loss_scale.LossScaler (precision="fp16")

    @functools.cached_property
    def _groups(self) -> List[Optimizer]:
        """The optimizer's parameter groups, made once (not on every step)."""
        return self.optimizer.groups()

    def _overflowed(self, finite: bool) -> bool:
        """precision="fp16": the scale updated as GradScaler does (runtime/loss_scale.py)
        from whether the step's gradients (and loss) were finite on every rank; True when
        they overflowed float16 above a scale of 1 — a routine event while the scale
        settles, counted as a skipped step (logged). At a scale of 1 or below (DeepSpeed's
        min_loss_scale) an overflow is a divergence, for ``nonfinite`` to decide: False."""
        scale = self._scaler.scale
        self._scaler.update(found_inf=not finite)
        if finite or scale <= 1.0:
            return False
        self.skipped_steps += 1
        _LOG.info("step %d: gradients overflowed float16 at loss scale %g; the update was "
                  "skipped on every rank and the scale is now %g", self.step_count + 1, scale,
                  self._scaler.scale)
        return True

    def _next_hypers(self) -> Tuple[Dict[str, float], float]:
        """update_hypers for this step's update (the steps taken minus those skipped)."""
        return update_hypers(self._groups, self.lr_schedule,
                             self.step_count - self.skipped_steps)

    def _loss_of(self, output: Any) -> float:
        """The step's loss output as a float; under clipping it is [loss, norm] and the norm
        is kept as ``last_grad_norm``."""
        value = output.numpy()
        if self.max_grad_norm is not None:  # [loss, global gradient norm before clipping]
            value, self._last_grad_norm = value[0], float(value[1])
        return float(value)

    @property
    def last_lr(self) -> float:
        """The learning rate of the last step (before the first: the one it will use)."""
        if self._last_lr is None:
            return update_hypers(self._groups, self.lr_schedule, 0)[1]
        return self._last_lr

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient norm of the last step, before clipping (None without
        ``max_grad_norm`` or before the first step)."""
        return self._last_grad_norm

    @property
    def loss_scale(self) -> Optional[float]:
        """The current loss scale under precision="fp16" (None otherwise)."""
        return None if self._scaler is None else self._scaler.scale

    def metrics(self) -> Dict[str, Any]:
        """The last step's measurements (runtime/metrics.py); {} before the first."""
        return dict(self._metrics.last)

    def loop_state(self) -> Dict[str, Any]:
        """The loop's host state a checkpoint keeps (JSON): the steps the non-finite guard
        skipped (the optimizer's own step count leaves them out) and the loss scaler's."""
        state: Dict[str, Any] = {"skipped_steps": self.skipped_steps}
        if self._scaler is not None:
            state["loss_scale"] = self._scaler.state_dict()
        return state

    def load_loop_state(self, state: Dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self._scaler is not None and "loss_scale" in state:
            self._scaler.load_state_dict(state["loss_scale"])
