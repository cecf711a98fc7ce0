"""Skip the optimizer update of a step whose gradients (or loss) are not finite, inside the step.

``finite_flag`` reduces each gradient to its sum (NaN and ±inf survive a sum) and ands the
sums' ``isfinite`` into one 0-d bool. (Not ``isfinite(sum_k 0 * sum(g_k))``: TVM's arithmetic
simplifier folds ``x * 0`` to 0, and the flag was always set.) A sum of finite gradients
overflows float32 only for gradients near 1e38 / numel, which is a divergence anyway. One
extra read of each gradient, inside the compiled step.

``keep_unless`` selects the updated value when the flag is set and the old one otherwise;
it is elementwise with a scalar condition, so it fuses into the update's kernel and the
update stays in place (compiler/inplace_update.py). ``flag_loss`` turns the returned loss
into NaN when the update was skipped, so the host learns of a non-finite gradient without a
second output.

Contract with the distribution passes: the flag must be the same on every rank. Under plain
data parallelism (AllReduceGradients) the optimizer reads the all-reduced gradients, which
every rank holds identically, so the flag agrees; the (local) loss is left out there. ZeRO
updates each bucket's shard as soon as it is reduced, before the other gradients exist, so
the step is built without this guard under ZeRO and ShardZeRO emits its own (passes/zero.py:
every shard reduced first, one agreed verdict, the sharded tables' gradients included).
Under tensor parallelism the ranks of a tp group hold different pieces of the split
parameters' gradients, so their verdicts are summed across the group (``across_tp``).
"""
from typing import Optional, Sequence

from tvm import relax

from ..ir.utils import sum_all


def finite_flag(bb: relax.BlockBuilder, grads: Sequence[relax.Expr],
                loss: Optional[relax.Expr] = None, across_tp: bool = False,
                across_dp: bool = False) -> Optional[relax.Var]:
    """A 0-d bool: every gradient (and ``loss`` when given) is finite. ``across_tp``: the
    gradients are split across tensor-parallel ranks, so each rank's verdict is summed over
    the tp group (g, passes/tp_ops.py) and the update runs only where every rank's is set.
    ``across_dp``: some gradients are this rank's alone (sharded embedding tables), so the
    verdict is summed over the dp group too (``R.ccl.allreduce``, passes/lower_allreduce.py)."""
    op = relax.op
    terms = [sum_all(bb, g) for g in grads] + ([loss] if loss is not None else [])
    flag = None
    for term in terms:
        finite = bb.emit(op.isfinite(term))
        flag = finite if flag is None else bb.emit(op.logical_and(flag, finite))
    if across_tp and flag is not None:
        from ..ir.ops import tp_reduce

        bad = bb.emit(op.where(flag, relax.const(0.0, "float32"), relax.const(1.0, "float32")))
        flag = bb.emit(op.less(bb.emit(tp_reduce(bad)), relax.const(0.5, "float32")))
    if across_dp and flag is not None:
        bad = bb.emit(op.where(flag, relax.const(0.0, "float32"), relax.const(1.0, "float32")))
        flag = bb.emit(op.less(bb.emit(op.ccl.allreduce(bad, "sum")),
                               relax.const(0.5, "float32")))
    return flag


def keep_unless(bb: relax.BlockBuilder, flag: relax.Var, new: relax.Expr,
                old: relax.Expr) -> relax.Var:
    """``new`` where ``flag`` is set, else ``old`` (the update skipped)."""
    return bb.emit(relax.op.where(flag, new, old))


def flag_loss(bb: relax.BlockBuilder, flag: relax.Var, loss: relax.Expr) -> relax.Var:
    """The loss, or NaN when the update was skipped."""
    nan = relax.const(float("nan"), loss.ty.dtype)
    return bb.emit(relax.op.where(flag, loss, nan))
