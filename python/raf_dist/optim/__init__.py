"""Optimizers emitted into the training step, with torch.optim's update rules and defaults.

Each optimizer declares its per-parameter state, the per-step scalars the host computes in
float64 (learning rate, bias corrections: so the IR has no step-dependent constants and
learning-rate schedules need no recompilation), and emits its update as Relax ops.
"""
from . import schedules
from .adagrad import Adagrad, RowWiseAdagrad
from .adam import Adam, AdamW
from .optimizer import Optimizer, group_hyper_name
from .sgd import SGD

__all__ = ["Adagrad", "Adam", "AdamW", "Optimizer", "RowWiseAdagrad", "SGD", "group_hyper_name",
           "schedules"]
