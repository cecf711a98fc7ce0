"""Dynamic loss scaling for ``Trainer(precision="fp16")`` (DESIGN.md section 1, "Mixed
precision"), with ``torch.amp.GradScaler``'s defaults and update rule.

float16 has 5 exponent bits: gradients below 2^-24 flush to zero. The step multiplies the loss
by ``scale`` before autodiff (through its ``loss_weight`` argument), so every gradient is
computed ``scale`` times too large, and multiplies the float32 gradients by ``1 / scale``
before the optimizer reads them (the ``grad_unscale`` hyper, training/step.py). A step whose
gradients overflow (inf / NaN anywhere, on any rank) is skipped by the step's own non-finite
guard (training/nonfinite.py, or ShardZeRO's under ZeRO) and the scale backs off; after
``growth_interval`` good steps in a row it grows. The scale is a power of two, so scaling
and unscaling are exact and the reported loss is the true one.

The scale lives on the host (the step returns a NaN loss when it skipped, so the host
learns of it without a second output); GradScaler keeps it on the device to avoid a sync,
which raf_dist pays anyway to return the loss.
"""
import math
from typing import Any, Dict


class LossScaler:
    """GradScaler's state machine: ``update(found_inf)`` after every step."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if int(growth_interval) < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0  # good steps in a row since the scale last changed

    def update(self, found_inf: bool) -> None:
        """As ``torch._amp_update_scale_``: back off and reset the tracker on an overflow;
        otherwise count the step and grow once the tracker reaches ``growth_interval``."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):  # as torch: a scale that would overflow stays
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps (GradScaler.state_dict's keys)."""
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])
