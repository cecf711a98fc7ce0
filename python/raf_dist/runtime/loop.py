"""The host-side scalars of one optimizer update, alike for both executors: which update it
is (steps the non-finite guard skipped are not updates: Adam's bias correction and the
learning-rate schedule leave them out, as torch.optim and LambdaLR never see them), its
learning rate, and the optimizer's hypers for it."""
from typing import Callable, Dict, Optional, Tuple

from ..optim import Optimizer
from ..optim.schedules import multiplier


def update_hypers(optimizer: Optimizer, lr_schedule: Optional[Callable[[int], float]],
                  updates: int) -> Tuple[Dict[str, float], float]:
    """(the optimizer's hyper values, the learning rate) for the update that follows
    ``updates`` updates taken (k = ``updates``: 0 first)."""
    lr = optimizer.lr * (1.0 if lr_schedule is None else multiplier(lr_schedule, updates))
    return optimizer.hyper_values(updates + 1, lr=lr), lr
