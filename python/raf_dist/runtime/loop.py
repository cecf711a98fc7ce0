"""The host-side scalars of one optimizer update, alike for both executors: which update it
is (steps the non-finite guard skipped are not updates: Adam's bias correction and the
learning-rate schedule leave them out, as torch.optim and LambdaLR never see them), its
learning rate, and the optimizer's hypers for it."""
from typing import Callable, Dict, Optional, Tuple

from ..optim import Optimizer, group_hyper_name
from ..optim.schedules import multiplier


def update_hypers(optimizer: Optimizer, lr_schedule: Optional[Callable[[int], float]],
                  updates: int) -> Tuple[Dict[str, float], float]:
    """(the hyper values of every parameter group, by step argument name; the learning rate
    of the optimizer's own values) for the update that follows ``updates`` updates taken
    (k = ``updates``: 0 first). The schedule multiplies every group's lr."""
    factor = 1.0 if lr_schedule is None else multiplier(lr_schedule, updates)
    values: Dict[str, float] = {}
    for g, group in enumerate(optimizer.groups()):
        for name, value in group.hyper_values(updates + 1, lr=group.lr * factor).items():
            values[group_hyper_name(g, name)] = value
    return values, optimizer.lr * factor
