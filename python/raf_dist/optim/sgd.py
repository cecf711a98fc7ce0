"""SGD with momentum, Nesterov momentum and L2 weight decay, as torch.optim.SGD
(dampening 0): d = g + wd*p; buf = momentum*buf + d (buf = d on the first step, which a
zero-initialised buffer gives exactly); d = d + momentum*buf if nesterov else buf; p -= lr*d."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from tvm import relax

from ..ir.ops import EMBEDDING_SGD_ROWS
from .optimizer import Keep, Optimizer, check_positive, const, kept


class SGD(Optimizer):
    hyper_names: tuple[str, ...] = ("lr",)

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False,
                 param_groups: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(lr, param_groups)
        check_positive("momentum", momentum, allow_zero=True)
        check_positive("weight_decay", weight_decay, allow_zero=True)
        if nesterov and momentum <= 0:
            raise ValueError("nesterov=True requires momentum > 0 (as in torch.optim.SGD)")
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)
        self.state_names = ("momentum_buffer",) if self.momentum else ()

    def hyper_values(self, step: int, lr: float | None = None) -> dict[str, float]:
        return {"lr": self.lr if lr is None else lr}

    @property
    def updates_rows(self) -> bool:  # type: ignore[override]
        """Plain SGD (no momentum, no weight decay) changes only the rows a table's gradient
        touches, so a sharded embedding table may be updated sparsely (training/step.py)."""
        return not self.momentum and not self.weight_decay

    def emit_row_update(self, bb: relax.BlockBuilder, param: relax.Expr,
                        states: Sequence[relax.Expr], ids: relax.Expr, rows: relax.Expr,
                        hyper: Mapping[str, relax.Expr],
                        keep: relax.Expr) -> tuple[relax.Expr, list[relax.Expr]]:
        """``table[ids] -= lr * rows`` in place (runtime/embedding_update.py)."""
        return bb.emit(relax.call_pure_packed(EMBEDDING_SGD_ROWS, param, ids, rows, hyper["lr"],
                                              keep, ty_args=param.ty)), []

    def emit_update(self, bb: relax.BlockBuilder, param: relax.Expr, grad: relax.Expr,
                    states: Sequence[relax.Expr], hyper: Mapping[str, relax.Expr],
                    keep: Keep | None = None) -> tuple[relax.Expr, list[relax.Expr]]:
        d = grad
        if self.weight_decay:
            d = bb.emit(relax.op.add(d, bb.emit(relax.op.multiply(param, const(self.weight_decay, param)))))
        new_states: list[relax.Expr] = []
        if self.momentum:
            buf = kept(keep, bb.emit(relax.op.add(bb.emit(relax.op.multiply(
                states[0], const(self.momentum, param))), d)), states[0])
            new_states.append(buf)
            if self.nesterov:
                d = bb.emit(relax.op.add(d, bb.emit(relax.op.multiply(buf, const(self.momentum, param)))))
            else:
                d = buf
        step = bb.emit(relax.op.multiply(d, hyper["lr"]))
        return bb.emit(relax.op.subtract(param, step)), new_states
