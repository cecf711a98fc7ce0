"""The optimizer interface the training-step builder uses."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from tvm import relax

#: the non-finite guard (training/nonfinite.py): ``keep(new, old)`` selects the kept value
Keep = Callable[[relax.Expr, relax.Expr], relax.Expr]


class Optimizer:
    """Base class. Subclasses set ``state_names`` and ``hyper_names`` and implement
    ``hyper_values`` and ``emit_update``."""

    state_names: tuple[str, ...] = ()  # per-parameter state tensors, each shaped like the parameter
    hyper_names: tuple[str, ...] = ()  # per-step float scalars computed on the host

    def __init__(self, lr: float) -> None:
        _check_positive("lr", lr, allow_zero=True)
        self.lr = float(lr)

    def hyper_values(self, step: int, lr: float | None = None) -> dict[str, float]:
        """Scalars for 1-based ``step``, as a dict name -> float (computed in float64).
        ``lr``: this step's learning rate (a schedule's; default ``self.lr``)."""
        raise NotImplementedError

    def emit_update(self, bb: relax.BlockBuilder, param: relax.Expr, grad: relax.Expr,
                    states: Sequence[relax.Expr], hyper: Mapping[str, relax.Expr],
                    keep: Keep | None = None) -> tuple[relax.Expr, list[relax.Expr]]:
        """Emit the update of one parameter. ``states``: list of Relax vars in
        ``state_names`` order; ``hyper``: name -> 0-d tensor var. Returns
        (new_param, [new_state, ...]). ``keep(new, old)`` (the non-finite guard,
        training/nonfinite.py), when given, is applied to each new state right where it is
        computed and the update reads the kept value: each select then has one producer and
        fuses into that state's kernel (applied to the outputs afterwards, the new state has two
        readers, the select and the parameter's update, and the select is a pass of its own)."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """Hyper-parameters, for checkpoints and cache keys."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def kept(keep: Keep | None, new: relax.Expr, old: relax.Expr) -> relax.Expr:
    """``keep(new, old)``, or ``new`` without a guard."""
    return new if keep is None else keep(new, old)


def const(value: float, like: relax.Expr) -> relax.Expr:
    """A scalar constant of ``like``'s dtype."""
    return relax.const(value, like.ty.dtype)


def _check_positive(name: str, value: object, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_beta(name: str, value: float) -> None:
    _check_positive(name, value, allow_zero=True)
    if not value < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
