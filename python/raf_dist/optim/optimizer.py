"""The optimizer interface the training-step builder uses."""
from __future__ import annotations

import copy
import fnmatch
import inspect
from typing import Any, Callable, Mapping, Sequence

from tvm import relax

#: the non-finite guard (training/nonfinite.py): ``keep(new, old)`` selects the kept value
Keep = Callable[[relax.Expr, relax.Expr], relax.Expr]


class Optimizer:
    """Base class. Subclasses set ``state_names`` and ``hyper_names`` and implement
    ``hyper_values`` and ``emit_update``."""

    state_names: tuple[str, ...] = ()  # per-parameter state tensors, each shaped like the parameter
    # ... but these, kept one value per row (raf_dist.layout.state_shape): row-wise Adagrad's
    row_states: tuple[str, ...] = ()
    hyper_names: tuple[str, ...] = ()  # per-step float scalars computed on the host
    #: whether a table may be updated on its looked-up rows only (``emit_row_update``): an
    #: untouched row is left as it is by the dense update too
    updates_rows: bool = False

    def __init__(self, lr: float, param_groups: Sequence[Mapping[str, Any]] | None = None) -> None:
        check_positive("lr", lr, allow_zero=True)
        self.lr = float(lr)
        self.param_groups = _checked_groups(param_groups)

    # ---- parameter groups (DESIGN.md section 1, "Training-loop essentials") -----------------
    def group_options(self) -> tuple[str, ...]:
        """The hyper-parameters a parameter group may set: the constructor's, but the groups."""
        names = inspect.signature(type(self).__init__).parameters
        return tuple(n for n in names if n not in ("self", "param_groups"))

    def groups(self) -> list[Optimizer]:
        """One optimizer per group: [this one's values (parameters no group matches), then
        each of ``param_groups`` with its own values over this one's]. Every group keeps the
        same state (a group turning SGD's momentum on or off is refused)."""
        out: list[Optimizer] = [self]
        own = {n: getattr(self, n) for n in self.group_options()}
        for i, group in enumerate(self.param_groups):
            bad = sorted(set(group) - {"params"} - set(own))
            if bad:
                raise ValueError(f"param_groups[{i}] sets {bad}, which {type(self).__name__} "
                                 f"does not have; a group may set {sorted(own)}")
            options = {**own, **{k: v for k, v in group.items() if k != "params"}}
            member = type(self)(**options)
            if tuple(member.state_names) != tuple(self.state_names):
                raise ValueError(f"param_groups[{i}] changes the optimizer's state "
                                 f"({list(self.state_names)} -> {list(member.state_names)}); "
                                 "every group must keep the same state (e.g. momentum on "
                                 "in every group or in none)")
            out.append(member)
        return out

    def assign(self, names: Sequence[str], check: bool = True) -> list[int]:
        """The group of each parameter name: the first group with a pattern (fnmatch) that
        matches it (1-based: param_groups[0] is 1), else 0 (this optimizer's own values).
        ``check``: a pattern that matches none of ``names`` is a ValueError naming it."""
        index = []
        for name in names:
            found = 0
            for g, group in enumerate(self.param_groups, start=1):
                if any(fnmatch.fnmatchcase(name, p) for p in group["params"]):
                    found = g
                    break
            index.append(found)
        if check:
            for g, group in enumerate(self.param_groups):
                for pattern in group["params"]:
                    if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                        shown = ", ".join(list(names)[:8]) + (", ..." if len(names) > 8 else "")
                        raise ValueError(
                            f"param_groups[{g}] pattern {pattern!r} matches no trained "
                            f"parameter (names as state_dict() gives them: {shown}); fix "
                            "the pattern or drop it")
        return index

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

    def initial_state_values(self) -> dict[str, float]:
        """{state name: the value a fresh state is filled with}; the others start at 0."""
        return {}

    def initial_states_by_param(self, names: Sequence[str]) -> list[dict[str, float]]:
        """``initial_state_values`` of each parameter of ``names``: its group's (Adagrad's
        groups may not set theirs, as torch.optim.Adagrad ignores a group's; an optimizer
        whose groups may is filled per group)."""
        groups = self.groups()
        return [groups[g].initial_state_values() for g in self.assign(names, check=False)]

    def emit_row_update(self, bb: relax.BlockBuilder, param: relax.Expr,
                        states: Sequence[relax.Expr], ids: relax.Expr, rows: relax.Expr,
                        hyper: Mapping[str, relax.Expr],
                        keep: relax.Expr) -> tuple[relax.Expr, list[relax.Expr]]:
        """The update of a sharded table on its looked-up rows (``updates_rows``): ``ids``,
        their gradients ``rows`` (duplicates not yet summed), in place when the 0-d bool
        ``keep`` is set. Returns (new_param, [new_state, ...])."""
        raise NotImplementedError(f"{type(self).__name__} has no sparse row update")

    def config(self) -> dict[str, Any]:
        """Hyper-parameters, for checkpoints and cache keys."""
        return {k: copy.deepcopy(v) for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def kept(keep: Keep | None, new: relax.Expr, old: relax.Expr) -> relax.Expr:
    """``keep(new, old)``, or ``new`` without a guard."""
    return new if keep is None else keep(new, old)


def const(value: float, like: relax.Expr) -> relax.Expr:
    """A scalar constant of ``like``'s dtype."""
    return relax.const(value, like.ty.dtype)


def group_hyper_name(group: int, name: str) -> str:
    """The step argument of hyper ``name`` for parameter group ``group`` (0: the plain name)."""
    return name if group == 0 else f"group{group}_{name}"


def _checked_groups(groups: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """``param_groups`` as a list of plain dicts, each with a non-empty list of patterns."""
    if groups is None:
        return []
    if isinstance(groups, (str, bytes, Mapping)) or not isinstance(groups, Sequence):
        raise TypeError(f"param_groups must be a list of dicts, got {groups!r}")
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ValueError(f"param_groups[{i}] must be a dict with a 'params' list of "
                             f"fnmatch patterns over state_dict() names, got {group!r}")
        patterns = group["params"]
        if isinstance(patterns, str):
            patterns = [patterns]
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"param_groups[{i}]['params'] must be a non-empty list of "
                             f"patterns (strings), got {group['params']!r}")
        out.append({**dict(group), "params": list(patterns)})
    return out


def check_positive(name: str, value: object, allow_zero: bool = False) -> None:
    """Raise unless hyperparameter ``name`` is a number > 0 (>= 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def check_beta(name: str, value: float) -> None:
    """Raise unless ``name`` (an Adam beta) lies in [0, 1)."""
    check_positive(name, value, allow_zero=True)
    if not value < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
