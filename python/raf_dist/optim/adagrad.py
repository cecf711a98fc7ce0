"""Adagrad as torch.optim.Adagrad, and row-wise Adagrad as torchrec.optim.RowWiseAdagrad (the
recommenders' optimizer for embedding tables: one accumulator per row, not per element):

    g = g + wd*p                                  (L2 weight decay)
    clr = lr / (1 + (t - 1) * lr_decay)           (computed on the host in float64)
    sum = sum + g*g                               | sum = sum + mean(g*g over the row)  (row-wise)
    p = p - clr * g / (sqrt(sum) + eps)

Row-wise, ``sum`` of a (rows, dim) table is (rows, 1) (raf_dist.layout.row_state_shape: the
leading axis kept, the others 1) and broadcasts over its row; a parameter of 0 or 1 axes is its
own rows, so its update is plain Adagrad. The state of a table then costs 1/dim of the table,
which is why recommenders use it (FBGEMM's EXACT_ROWWISE_ADAGRAD, torchrec's default).

A row the step's gradient does not touch is unchanged by either update (its sum gains 0, its
parameter moves by 0 / (sqrt(sum) + eps)), so a sharded table's update may run on the looked-up
rows only (``emit_row_update``: runtime/embedding_update.py), with the duplicates' gradients
summed first, as the dense gradient sums them.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from tvm import relax

from ..ir.ops import EMBEDDING_ADAGRAD_ROWS, EMBEDDING_ADAGRAD_SUM
from .optimizer import Keep, Optimizer, check_positive, const, kept


class Adagrad(Optimizer):
    """torch.optim.Adagrad (lr 0.01, lr_decay 0, weight_decay 0, initial_accumulator_value 0,
    eps 1e-10)."""

    state_names: tuple[str, ...] = ("sum",)
    hyper_names: tuple[str, ...] = ("clr",)

    def __init__(self, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                 param_groups: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(lr, param_groups)
        check_positive("lr_decay", lr_decay, allow_zero=True)
        check_positive("weight_decay", weight_decay, allow_zero=True)
        check_positive("initial_accumulator_value", initial_accumulator_value, allow_zero=True)
        check_positive("eps", eps, allow_zero=True)
        self.lr_decay = float(lr_decay)
        self.weight_decay = float(weight_decay)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.eps = float(eps)
        for i, group in enumerate(self.param_groups):
            if "initial_accumulator_value" in group:
                raise ValueError(
                    f"param_groups[{i}] sets initial_accumulator_value, which torch.optim."
                    "Adagrad reads from the constructor only (a group's is ignored there): "
                    f"set it on {type(self).__name__}(initial_accumulator_value=...) itself")

    def initial_state_values(self) -> dict[str, float]:
        return {"sum": self.initial_accumulator_value}

    def hyper_values(self, step: int, lr: float | None = None) -> dict[str, float]:
        lr = self.lr if lr is None else lr
        return {"clr": lr / (1 + (step - 1) * self.lr_decay)}

    @property
    def updates_rows(self) -> bool:  # type: ignore[override]
        """Without weight decay an untouched row stays as it is (module docstring); with
        ``eps`` 0 and an empty accumulator the dense update would make it 0/0, as PyTorch's."""
        return not self.weight_decay and (self.eps > 0 or self.initial_accumulator_value > 0)

    def _squares(self, bb: relax.BlockBuilder, grad: relax.Expr) -> relax.Expr:
        g2 = bb.emit(relax.op.multiply(grad, grad))
        ndim = len(grad.ty.shape)
        if not self.row_states or ndim < 2:
            return g2
        return bb.emit(relax.op.mean(g2, axis=list(range(1, ndim)), keepdims=True))

    def emit_update(self, bb: relax.BlockBuilder, param: relax.Expr, grad: relax.Expr,
                    states: Sequence[relax.Expr], hyper: Mapping[str, relax.Expr],
                    keep: Keep | None = None) -> tuple[relax.Expr, list[relax.Expr]]:
        op = relax.op
        if self.weight_decay:
            grad = bb.emit(op.add(grad, bb.emit(op.multiply(param, const(self.weight_decay,
                                                                         param)))))
        total = kept(keep, bb.emit(op.add(states[0], self._squares(bb, grad))), states[0])
        denom = bb.emit(op.add(bb.emit(op.sqrt(total)), const(self.eps, param)))
        step = bb.emit(op.multiply(bb.emit(op.divide(grad, denom)), hyper["clr"]))
        return bb.emit(op.subtract(param, step)), [total]

    def emit_row_update(self, bb: relax.BlockBuilder, param: relax.Expr,
                        states: Sequence[relax.Expr], ids: relax.Expr, rows: relax.Expr,
                        hyper: Mapping[str, relax.Expr],
                        keep: relax.Expr) -> tuple[relax.Expr, list[relax.Expr]]:
        """The update of table ``param`` on its looked-up rows only: ``ids`` and their
        gradients ``rows`` (duplicates summed by the runtime), in place, when ``keep`` (the
        step's finite verdict) is set. The accumulator first, the rows read it."""
        dtype = str(param.ty.dtype)
        total = bb.emit(relax.call_pure_packed(
            EMBEDDING_ADAGRAD_SUM, states[0], ids, rows, keep,
            relax.const(bool(self.row_states), "bool"), ty_args=states[0].ty))
        new_param = bb.emit(relax.call_pure_packed(
            EMBEDDING_ADAGRAD_ROWS, param, total, ids, rows, hyper["clr"],
            relax.const(self.eps, dtype), keep, ty_args=param.ty))
        return new_param, [total]


class RowWiseAdagrad(Adagrad):
    """torchrec.optim.RowWiseAdagrad: Adagrad with one accumulator per row of each parameter
    (``sum`` of a (rows, dim) table is (rows, 1)); same defaults as Adagrad. Not with ZeRO or
    tensor parallelism (their shards would cut rows: the Trainer refuses them)."""

    row_states = ("sum",)
