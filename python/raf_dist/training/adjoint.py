"""What the step builders read of TVM's Gradient pass, before and after it runs: the ops of a
forward that have no registered gradient, and in the adjoint Gradient returns
(``main_loss_adjoint``) where the forward ends, the loss and the gradients, the aliases it
leaves, the casts AutoCast made of the parameters and the row gradients of table lookups.

Analysis only: nothing here emits a binding. training/step.py (the one-function step) and
training/pipeline_step.py (a pipeline stage's functions) build from what it finds.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tvm
from tvm import relax

from ..passes.auto_cast import LOW_DTYPES
from . import gradients

#: {bound variable: its value}, as a function's bindings define them
Bound = Dict[relax.Var, relax.Expr]

_ASTYPE = tvm.ir.Op.get("relax.astype")
_TAKE_BACKWARD = tvm.ir.Op.get("relax.grad.take_backward")
_ADD = tvm.ir.Op.get("relax.add")


def missing_gradients(func: relax.Function) -> List[Tuple[str, str]]:
    """Ops in ``func`` that have no registered gradient: [(op name, bound var name)].
    Integer/bool computations (masks, positions) need none (gradients.has_gradient)."""
    missing: List[Any] = []

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if not gradients.has_gradient(expr):
                missing.append(expr.op.name)

    for block in func.body.blocks:
        for binding in block.bindings:
            before = len(missing)
            relax.analysis.post_order_visit(binding.value, visit)
            missing[before:] = [(name, binding.var.name) for name in missing[before:]]
    return missing


def forward_length(adjoint: relax.Function) -> int:
    """How many of the adjoint's leading bindings are the forward and the loss: up to the
    binding of the loss it returns (and of the new buffers returned beside it). Counted on
    the adjoint, not on the function Gradient read: Gradient drops the forward's unused
    bindings (an AutoCast forward had 369, its adjoint 339 before the backward began)."""
    bindings = [b for block in adjoint.body.blocks for b in block.bindings]
    position = {b.var: i for i, b in enumerate(bindings)}
    bound = {b.var: b.value for b in bindings}
    outputs = [_unwrap(adjoint.body.body, bound).fields[0]]
    last = -1
    while outputs:
        value = outputs.pop()
        if isinstance(value, relax.Tuple):
            outputs.extend(value.fields)
        elif isinstance(value, relax.Var) and value in position:
            last = max(last, position[value])
            if isinstance(bound[value], (relax.Tuple, relax.Var)):  # (loss, *new buffers)
                outputs.append(bound[value])
    return last + 1


def follow_aliases(var: relax.Expr, value: Bound) -> relax.Expr:
    """Through ``a = b`` aliases (``value``: each bound variable's value) to the binding that
    computes ``var``."""
    while isinstance(var, relax.Var) and isinstance(value.get(var), relax.Var):
        var = value[var]
    return var


def loss_and_grads(adjoint: relax.Function
                   ) -> Tuple[relax.Expr, List[relax.Expr], List[relax.Expr]]:
    """The adjoint function returns (loss, (grad, ...)), or ((loss, *new buffers), (grad,
    ...)) for a forward that updates buffers: (loss, [grad, ...], [new buffer, ...])."""
    bound = {b.var: b.value for block in adjoint.body.blocks for b in block.bindings}
    loss_value, grads = _unwrap(adjoint.body.body, bound).fields
    grads = _unwrap(grads, bound)
    new_buffers = []
    if isinstance(loss_value.ty, relax.TupleType):
        loss_value, *new_buffers = _unwrap(loss_value, bound).fields
    return loss_value, list(grads.fields), new_buffers


def _unwrap(expr: relax.Expr, bound: Bound) -> relax.Expr:
    """``expr`` through the variables ``bound`` binds it to, down to the value."""
    while isinstance(expr, relax.Var) and expr in bound:
        expr = bound[expr]
    return expr


def parameter_casts(adjoint: relax.Function, param_vars: Sequence[relax.Var]
                    ) -> Dict[int, Tuple[relax.Var, str]]:
    """{trained parameter index: (the binding var of its cast to a 16-bit float, dtype)}: the
    copies AutoCast made of the parameters themselves (one per parameter and dtype; a
    parameter cast to two 16-bit dtypes, which AutoCast never does, keeps its casts).

    Matrices and kernels only (two axes or more): their copies are the bytes (the forward
    keeps them for the backward's products), and their casts are kernels of their own that
    round to nearest even, as the host's cast does. A vector's cast (a bias, a norm's
    scale) costs nothing held, and FuseOps fuses it into the elementwise kernel reading it,
    where TVM's bf16 legalisation drops the rounding (the add reads the float32 value);
    a copy would round it and change the step's arithmetic."""
    index = {v: i for i, v in enumerate(param_vars)}
    found: Dict[int, Tuple[relax.Var, str]] = {}
    seen = set()
    for block in adjoint.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not (isinstance(value, relax.Call) and value.op.same_as(_ASTYPE)
                    and value.args[0] in index):
                continue
            i, dtype = index[value.args[0]], str(binding.var.ty.dtype)
            if dtype not in LOW_DTYPES or len(binding.var.ty.shape) < 2:
                continue
            if i in seen:  # a second cast of the same parameter: leave both in the step
                found.pop(i, None)
                continue
            seen.add(i)
            found[i] = (binding.var, dtype)
    return found


def row_gradients(grad: relax.Expr, value: Bound, param: relax.Var
                  ) -> Optional[List[Tuple[relax.Expr, relax.Expr]]]:
    """[(ids, rows)] when ``grad`` (the adjoint's gradient of table ``param``) is a sum of
    take_backward(rows, param, ids, axis=0) scatter-adds (its lookups' gradients); else
    None."""
    bound = value.get(grad) if isinstance(grad, relax.Var) else None
    if isinstance(bound, relax.Var):
        return row_gradients(bound, value, param)
    if not isinstance(bound, relax.Call):
        return None
    if bound.op.same_as(_TAKE_BACKWARD) and bound.args[1].same_as(param) \
            and bound.attrs.axis is not None and int(bound.attrs.axis) == 0:
        return [(bound.args[2], bound.args[0])]
    if bound.op.same_as(_ADD):
        parts = [row_gradients(a, value, param) for a in bound.args]
        if parts[0] is None or parts[1] is None:
            return None
        return parts[0] + parts[1]
    return None
