"""The optimizer's update as both step builders emit it (training/step.py's one-function step,
training/pipeline_step.py's update step over the accumulated gradients): the arguments it
reads (each parameter's group and hyper arguments, its optimizer states), the gradient
markers the distribution passes turn into collectives, and the update of every parameter
behind the optional clipping and non-finite guard.
"""
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tvm import relax

from ..ir.ops import EMBEDDING_ROWS_SQUARES as ROWS_SQUARES
from ..ir.ops import mark_gradient
from ..layout.state import state_shape
from ..optim import group_hyper_name
from ..optim.optimizer import Keep, Optimizer
from ..passes import clipping
from . import nonfinite

#: a parameter's group: (the group's optimizer, {hyper name: step argument name})
Updater = Tuple[Optimizer, Dict[str, str]]


def identifier(name: str) -> str:
    """``name`` (a parameter's, dotted) as a Relax variable name: each character that is
    not a letter or a digit becomes ``_``."""
    return "".join(c if c.isalnum() else "_" for c in name)


def state_type(param_type: relax.TensorType, state: str,
               row_states: Sequence[str]) -> relax.TensorType:
    """The Relax type of optimizer state ``state`` of a parameter of ``param_type``: the
    parameter's, or one value per row (raf_dist.layout.state_shape)."""
    shape = [int(d) for d in param_type.shape]
    return relax.TensorType(state_shape(shape, state, row_states), param_type.dtype)


def optimizer_groups(optimizer: Optimizer, names: Sequence[str]
                     ) -> Tuple[List[Updater], List[str], List[int]]:
    """(per parameter: (its group's optimizer, {hyper name: step argument name}); the hyper
    arguments of the groups in use, in order; each parameter's group index). The Trainer
    checked that every pattern matches a parameter of the whole model."""
    members = optimizer.groups()
    index = optimizer.assign(names, check=False)
    hyper_names = [group_hyper_name(g, h) for g in sorted(set(index))
                   for h in members[g].hyper_names]
    updaters = [(members[g], {h: group_hyper_name(g, h) for h in members[g].hyper_names})
                for g in index]
    return updaters, hyper_names, index


def mark_in(bb: relax.BlockBuilder, grad: relax.Expr, i: int,
            reduce_dtype: Optional[str]) -> relax.Var:
    """Gradient ``i``'s marker, the gradient cast to ``reduce_dtype`` first when it is
    reduced in another dtype (Trainer(grad_reduce_dtype="bfloat16"): half the bytes)."""
    if reduce_dtype is not None and str(grad.ty.dtype) != reduce_dtype:
        grad = bb.emit(relax.op.astype(grad, reduce_dtype))
    return bb.emit(mark_gradient(grad, i))


def in_param_dtypes(bb: relax.BlockBuilder, grads: Sequence[relax.Expr],
                    params: Sequence[relax.Var]) -> List[relax.Expr]:
    """The marked ``grads`` back in their parameters' dtypes, cast after every marker (the
    distribution passes reduce each bucket before its first reader)."""
    return [g if str(g.ty.dtype) == str(p.ty.dtype)
            else bb.emit(relax.op.astype(g, str(p.ty.dtype))) for g, p in zip(grads, params)]


def emit_update(bb: relax.BlockBuilder, updaters: Sequence[Updater],
                grads: Sequence[relax.Expr], loss_value: relax.Expr,
                param_vars: Sequence[relax.Var], state_vars: Sequence[relax.Var],
                hyper_vars: Mapping[str, relax.Var], new_buffers: Sequence[relax.Expr],
                nonfinite_guard: Optional[str], tensor_parallel: bool,
                clip: Optional[clipping.Clip] = None, across_dp: bool = False,
                sparse_rows: Optional[Dict[int, Tuple[relax.Expr, relax.Expr]]] = None,
                low: Sequence[Tuple[int, str]] = ()) -> relax.Var:
    """The optimizer's update of every parameter (skipped on a non-finite step when guarded;
    ``clip``, a passes.clipping.Clip: the gradients clipped first); returns the step's output
    tuple (loss or [loss, norm], *params, *states, *buffers, *16-bit copies of ``low``'s
    parameters). ``across_dp``: the verdict is agreed over the dp group (some gradients are
    this rank's alone). ``sparse_rows`` {parameter index: (ids, rows' gradients)}: those
    tables updated in place on the looked-up rows only (the optimizer's ``emit_row_update``:
    runtime/embedding_update.py); the non-finite check reads their rows."""
    sparse_rows = sparse_rows or {}
    norm = None
    if clip is not None:  # a sparsely updated table counts (and scales) its rows
        squares = [bb.emit(relax.call_pure_packed(ROWS_SQUARES, ids, rows,
                                                  ty_args=relax.TensorType((), "float32")))
                   for ids, rows in sparse_rows.values()]
        total = squares[0] if squares else None
        for term in squares[1:]:
            total = bb.emit(relax.op.add(total, term))
        norm = clipping.global_norm(
            bb, [None if i in sparse_rows else g for i, g in enumerate(grads)], clip, total)
        coef = clipping.clip_coefficient(bb, norm, clip.max_norm)
        clipped = [g if i in sparse_rows else clipping.scaled(bb, g, coef)
                   for i, g in enumerate(grads)]
        rows_of = {i: (ids, clipping.scaled(bb, rows, coef))
                   for i, (ids, rows) in sparse_rows.items()}
    flag = None
    if nonfinite_guard:
        flag = nonfinite.finite_flag(
            bb, [sparse_rows[i][1] if i in sparse_rows else g for i, g in enumerate(grads)],
            loss_value if nonfinite_guard == "gradients_and_loss" else None,
            across_tp=tensor_parallel, across_dp=across_dp)
    n_states = len(updaters[0][0].state_names) if updaters else 0
    keep: Optional[Keep] = (None if flag is None else
                            lambda new, old: nonfinite.keep_unless(bb, flag, new, old))
    if norm is not None:
        grads, sparse_rows = clipped, rows_of
    new_params, new_states = [], []
    for i, (param, grad) in enumerate(zip(param_vars, grads)):
        states = state_vars[i * n_states:(i + 1) * n_states]
        optimizer, arguments = updaters[i]  # the parameter's group
        if i in sparse_rows:  # in place, the looked-up rows only (runtime/embedding_update.py)
            ids, rows = sparse_rows[i]
            new_param, updated = optimizer.emit_row_update(
                bb, param, states, ids, rows, {h: hyper_vars[a] for h, a in arguments.items()},
                flag if flag is not None else relax.const(True, "bool"))
            new_params.append(new_param)
            new_states.extend(updated)
            continue
        # the states are kept (or not) where they are computed: optimizer.emit_update
        new_param, updated = optimizer.emit_update(
            bb, param, grad, states, {h: hyper_vars[a] for h, a in arguments.items()},
            keep=keep)
        if flag is not None:
            new_param = nonfinite.keep_unless(bb, flag, new_param, param)
        new_params.append(new_param)
        new_states.extend(updated)
    if norm is not None:
        loss_value = clipping.with_norm(bb, loss_value, norm)
    if flag is not None:
        loss_value = nonfinite.flag_loss(bb, flag, loss_value)
    # the next step's 16-bit copies (``low``: [(parameter index, dtype)]), cast from the new
    # parameters: FuseOps puts each cast in its parameter's update kernel
    copies = [bb.emit(relax.op.astype(new_params[i], dtype)) for i, dtype in low]
    return bb.emit_output(relax.Tuple([loss_value, *new_params, *new_states, *new_buffers,
                                       *copies]))
