"""Loss functions as Relax functions ``loss(prediction, target) -> scalar``.

``cross_entropy``: integer class targets, mean over the batch, as
``torch.nn.functional.cross_entropy`` (predictions (B, C) or (B, ..., C) with targets (B, ...)):
the fused op of cross_entropy.py (no log-probabilities held; its backward writes the logits'
gradient in their dtype).
``mse``: mean of squared differences, as ``torch.nn.functional.mse_loss``.

Under tensor parallelism the predictions may arrive split along their classes (the output
head column-parallel, passes/tensor_parallel.py): ``vocab_parallel`` builds Megatron's
vocabulary-parallel cross-entropy on the local piece, with no full logits on any rank:
the row max (allreduce max, no gradient: a shift the loss does not depend on), the sum of
exponentials and the target logit (the rank whose classes hold the target contributes it,
the others 0) are each reduced across the tp ranks by g, whose backward is the identity, so
autodiff yields the local softmax minus the local one-hot, as Megatron's hand-written
backward.
"""
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from tvm import relax

from .cross_entropy import cross_entropy

LOSSES = ("cross_entropy", "mse")


def build_loss(name: str, pred_shape: Sequence[int], pred_dtype: Any,
               target_shape: Optional[Sequence[int]] = None, target_dtype: Any = None,
               weighted: bool = False, vocab_parallel: bool = False
               ) -> Tuple[relax.Function, Tuple[Tuple[int, ...], Any]]:
    """The loss as a Relax function, with the target's expected shape and dtype.
    ``weighted``: the function takes a third argument, a 0-d ``loss_weight``, and returns
    the mean times it (data parallelism with uneven batches: training/batch_size.py).
    ``vocab_parallel``: the predictions are this tp rank's slice of the classes (above)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {LOSSES}")
    pred_shape = tuple(int(d) for d in pred_shape)
    if name == "cross_entropy":
        if len(pred_shape) < 2:
            raise ValueError(f"cross_entropy needs predictions of shape (batch, ..., classes), "
                             f"got {pred_shape}")
        target_shape = pred_shape[:-1] if target_shape is None else tuple(
            int(d) for d in target_shape)
        target_dtype = target_dtype or "int64"
        if int(np.prod(target_shape)) != int(np.prod(pred_shape[:-1])):
            raise ValueError(f"cross_entropy targets of shape {target_shape} do not match "
                             f"predictions of shape {pred_shape}: one class index per row, "
                             f"shape {pred_shape[:-1]}")
        if not str(target_dtype).startswith(("int", "uint")):
            raise ValueError(f"cross_entropy targets must be integer class indices, got "
                             f"{target_dtype}")
    else:
        target_shape = pred_shape if target_shape is None else tuple(target_shape)
        target_dtype = target_dtype or pred_dtype
    pred = relax.Var("prediction", relax.TensorType(pred_shape, pred_dtype))
    target = relax.Var("target", relax.TensorType(target_shape, target_dtype))
    arguments = [pred, target]
    if weighted:
        arguments.append(relax.Var("loss_weight", relax.TensorType((), pred_dtype)))
    bb = relax.BlockBuilder()
    with bb.function("loss", arguments):
        with bb.dataflow():
            if name == "cross_entropy" and vocab_parallel:
                logits, flat_target = pred, target
                if len(pred_shape) > 2:  # (B, ..., C) -> (B*..., C) as F.cross_entropy on flat
                    rows = int(np.prod(pred_shape[:-1]))
                    logits = bb.emit(relax.op.reshape(pred, (rows, pred_shape[-1])))
                    flat_target = bb.emit(relax.op.reshape(target, (rows,)))
                value = _vocab_parallel_cross_entropy(bb, logits, flat_target)
            elif name == "cross_entropy":  # one op, its own backward (cross_entropy.py)
                rows_target = target
                if tuple(target_shape) != pred_shape[:-1]:  # (B*T,) targets of (B, T, C)
                    rows_target = bb.emit(relax.op.reshape(target, pred_shape[:-1]))
                value = bb.emit(cross_entropy(pred, rows_target))  # float32 for any logits
            else:
                diff = bb.emit(relax.op.subtract(pred, target))
                squared = bb.emit(relax.op.multiply(diff, diff))
                value = bb.emit(relax.op.mean(squared))
            if weighted:
                weight = arguments[2]
                if str(value.ty.dtype) != str(pred_dtype):  # 16-bit predictions' weight
                    weight = bb.emit(relax.op.astype(weight, value.ty.dtype))
                value = bb.emit(relax.op.multiply(value, weight))
            out = bb.emit_output(value)
        bb.emit_func_output(out)
    return bb.get()["loss"], (target_shape, target_dtype)


def _vocab_parallel_cross_entropy(bb: relax.BlockBuilder, logits: relax.Expr,
                                  target: relax.Expr) -> relax.Var:
    """Mean cross-entropy of (rows, C/T) logits, this rank's classes [r C/T, (r+1) C/T)."""
    from ..ir.ops import tp_max, tp_rank, tp_reduce

    op = relax.op
    local = int(logits.ty.shape[-1])
    dtype = str(logits.ty.dtype)
    shift = bb.emit(tp_max(op.max(logits, axis=[-1], keepdims=True)))
    shifted = bb.emit(op.subtract(logits, shift))
    sum_exp = bb.emit(tp_reduce(op.sum(op.exp(shifted), axis=[-1])))
    start = bb.emit(op.multiply(tp_rank(target), relax.const(local, "int64")))
    mine = bb.emit(op.subtract(op.astype(target, "int64"), start))
    one_hot = bb.emit(op.astype(op.equal(op.expand_dims(mine, [-1]),
                                         op.arange(0, local, 1, "int64")), dtype))
    target_logit = bb.emit(tp_reduce(op.sum(op.multiply(shifted, one_hot), axis=[-1])))
    per_row = bb.emit(op.subtract(op.log(sum_exp), target_logit))
    return bb.emit(op.mean(per_row))


def num_classes(forward: relax.Function, name: str) -> Optional[int]:
    """The class count cross-entropy targets index (the prediction's last dimension), or
    None for a loss without class targets."""
    if name != "cross_entropy":
        return None
    out = forward.ret_ty
    if isinstance(out, relax.TupleType):  # (output, *new buffer values)
        out = out.fields[0]
    return int(out.shape[-1])


def check_targets(target: Any, classes: int) -> None:
    """Cross-entropy targets must lie in [0, classes): out of range, TVM's ``take`` would read
    outside the row (no bounds check in generated code) and the loss would be garbage."""
    target = np.asarray(target)
    if target.size == 0:
        return
    low, high = target.min(), target.max()
    if low < 0 or high >= classes:
        bad = low if low < 0 else high
        raise ValueError(f"cross_entropy target {bad} is outside [0, {classes}): the model "
                         f"predicts {classes} classes; targets must be class indices "
                         f"0..{classes - 1}")
