"""Adam and AdamW as torch.optim (non-amsgrad):

    g = g + wd*p                        (Adam's L2 weight decay)   | p = p*(1 - lr*wd)  (AdamW)
    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
    p = p - (lr / (1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps)

The step-dependent scalars lr/(1-b1^t), sqrt(1-b2^t) and 1-lr*wd are computed on the host in
float64, like torch does in Python, and passed in each step.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from tvm import relax

from .optimizer import Keep, Optimizer, check_beta, check_positive, const, kept


class Adam(Optimizer):
    state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    hyper_names: tuple[str, ...] = ("step_size", "bias_correction2_sqrt")
    decoupled = False

    def __init__(self, lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0,
                 param_groups: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(lr, param_groups)
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_beta("betas[0]", betas[0])
        check_beta("betas[1]", betas[1])
        check_positive("eps", eps, allow_zero=True)
        check_positive("weight_decay", weight_decay, allow_zero=True)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

    def hyper_values(self, step: int, lr: float | None = None) -> dict[str, float]:
        beta1, beta2 = self.betas
        lr = self.lr if lr is None else lr
        values = {"step_size": lr / (1 - beta1 ** step),
                  "bias_correction2_sqrt": math.sqrt(1 - beta2 ** step)}
        if self.decoupled:
            values["decay"] = 1 - lr * self.weight_decay
        return values

    def emit_update(self, bb: relax.BlockBuilder, param: relax.Expr, grad: relax.Expr,
                    states: Sequence[relax.Expr], hyper: Mapping[str, relax.Expr],
                    keep: Keep | None = None) -> tuple[relax.Expr, list[relax.Expr]]:
        beta1, beta2 = self.betas
        op = relax.op
        if self.decoupled and self.weight_decay:
            param = bb.emit(op.multiply(param, hyper["decay"]))
        elif self.weight_decay:
            grad = bb.emit(op.add(grad, bb.emit(op.multiply(param, const(self.weight_decay, param)))))
        exp_avg, exp_avg_sq = states
        m = kept(keep, bb.emit(op.add(bb.emit(op.multiply(exp_avg, const(beta1, param))),
                                      bb.emit(op.multiply(grad, const(1 - beta1, param))))),
                 exp_avg)
        g2 = bb.emit(op.multiply(grad, grad))
        v = kept(keep, bb.emit(op.add(bb.emit(op.multiply(exp_avg_sq, const(beta2, param))),
                                      bb.emit(op.multiply(g2, const(1 - beta2, param))))),
                 exp_avg_sq)
        denom = bb.emit(op.add(bb.emit(op.divide(bb.emit(op.sqrt(v)), hyper["bias_correction2_sqrt"])),
                               const(self.eps, param)))
        update = bb.emit(op.multiply(bb.emit(op.divide(m, denom)), hyper["step_size"]))
        return bb.emit(op.subtract(param, update)), [m, v]


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01, as torch.optim.AdamW)."""

    hyper_names = ("step_size", "bias_correction2_sqrt", "decay")
    decoupled = True

    def __init__(self, lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01,
                 param_groups: Sequence[Mapping[str, Any]] | None = None) -> None:
        super().__init__(lr, betas, eps, weight_decay, param_groups)
