"""Gradient clipping by the global L2 norm, inside the step (``Trainer(max_grad_norm=...)``;
DESIGN.md section 1, "Training-loop essentials"), as ``torch.nn.utils.clip_grad_norm_`` on one
process computes it:

    norm = sqrt(sum over every parameter of sum(g * g))
    g    = g * min(1, max_norm / (norm + 1e-6))

Every element is counted once whatever the layout, because the step knows how each gradient
is held when the optimizer reads it:
  - one process, data parallelism: every gradient whole (after the allreduce, the same on
    every rank): a local sum;
  - tensor parallelism: a split parameter's gradient is this tp rank's piece, so those sums
    are added over the tp group (``tp_reduce``); a replicated parameter's gradient is whole
    and the same on every tp rank, so it is counted once, locally;
  - ZeRO (passes/zero.py): each rank holds a shard of every gradient; the shards' sums are
    added over the dp group in the one small allreduce that also carries the non-finite
    verdict (padding is zeros); split / replicated as above;
  - pipelining (runtime/pipeline_executor.py): each stage's sum, added over the pp group; a tied
    parameter only on the stage that holds it first;
  - embedding tables sharded over the dp ranks (passes/embedding_parallel.py): a table's
    gradient is this rank's rows alone (the exchange already summed every rank's lookups),
    so those sums are added over the dp group (``local``); a table updated on its looked-up
    rows only has no dense gradient: its sum is the rows' (their duplicates summed first:
    runtime/embedding_update.py), given as ``local_squares``, and the clip scales the rows.
The norm is float32 (gradients of another dtype widen first) and goes back to the host as
the second element of the step's loss output (``with_norm``), the same float on every rank.
"""
import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

from tvm import relax

from ..ir.ops import tp_reduce
from ..ir.utils import sum_all

#: binds one value, returns its variable (BlockBuilder.emit, or a pass's own binder)
Emit = Callable[[relax.Expr], Any]

#: torch.nn.utils.clip_grad_norm_'s guard against dividing by a zero norm
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Clip:
    """What a step that clips needs to know of its gradients (one flag per parameter, step
    order): ``split``, a tensor-parallel piece (its sum of squares added over tp);
    ``counted``, counted on this rank (False: a tied parameter another pp rank counts;
    default all); ``across_pp``: this rank holds some pipeline stages (the sums are added
    over the pp group); ``local``: this rank's rows of a table sharded over the dp ranks
    (its sum added over the dp group)."""

    max_norm: float
    split: Tuple[bool, ...]
    counted: Tuple[bool, ...] = ()
    across_pp: bool = False
    local: Tuple[bool, ...] = ()

    def is_local(self, k: int) -> bool:
        return k < len(self.local) and bool(self.local[k])

    @property
    def any_split(self) -> bool:
        return any(s for k, s in enumerate(self.split) if self.kind(k) is not None)

    def kind(self, k: int) -> Optional[bool]:
        """None: not counted here; else whether parameter k is a tensor-parallel piece."""
        if self.counted and not self.counted[k]:
            return None
        return bool(self.split[k]) if k < len(self.split) else False


def global_norm(bb: relax.BlockBuilder, grads: Sequence[Optional[relax.Expr]], clip: Clip,
                local_squares: Optional[relax.Expr] = None) -> relax.Expr:
    """The 0-d float32 global L2 norm of the (whole, reduced) ``grads`` as ``clip`` says they
    are held (``norm_of``). ``grads[k]`` None: parameter k's sum is in ``local_squares``
    (a sparsely updated table's rows), which is added over the dp group with the other
    ``local`` gradients' sums."""
    counted = [(g, bool(clip.kind(k))) for k, g in enumerate(grads)
               if g is not None and clip.kind(k) is not None and not clip.is_local(k)]
    replicated, pieces = squares_by_kind(bb, [g for g, _ in counted], [s for _, s in counted])
    mine = [g for k, g in enumerate(grads) if g is not None and clip.is_local(k)]
    if mine or local_squares is not None:  # this rank's rows of the tables: summed over dp
        own = squares_by_kind(bb, mine)[0] if mine else None
        if local_squares is not None:
            own = local_squares if own is None else bb.emit(relax.op.add(own, local_squares))
        replicated = bb.emit(relax.op.add(replicated, bb.emit(relax.op.ccl.allreduce(own,
                                                                                     "sum"))))
    return norm_of(bb, replicated, pieces, clip)


def squares_by_kind(bb: relax.BlockBuilder, grads: Sequence[relax.Expr],
                    split: Sequence[bool] = (), emit: Optional[Emit] = None
                    ) -> Tuple[relax.Expr, Optional[relax.Expr]]:
    """This rank's 0-d float32 sums of every element squared of ``grads``: (those held whole,
    those that are tensor-parallel pieces, ``split[i]``; None when there are none).
    ``emit``: how a value is bound (default ``bb.emit``, whose long sums run on every core)."""
    op = relax.op
    if emit is None:  # long sums split across the cores (ir/utils.sum_all)
        bind: Emit = bb.emit

        def total(x: relax.Expr) -> Any:
            return sum_all(bb, x)
    else:  # a caller's binder: one op per binding
        bind = emit

        def total(x: relax.Expr) -> Any:
            return bind(op.sum(x))
    local, pieces = None, None
    for i, g in enumerate(grads):
        if str(g.ty.dtype) != "float32":
            g = bind(op.astype(g, "float32"))
        term = total(bind(op.multiply(g, g)))
        if i < len(split) and split[i]:
            pieces = term if pieces is None else bind(op.add(pieces, term))
        else:
            local = term if local is None else bind(op.add(local, term))
    return (local if local is not None else relax.const(0.0, "float32")), pieces


def norm_of(bb: relax.BlockBuilder, replicated: relax.Expr, pieces: Optional[relax.Expr],
            clip: Clip, emit: Optional[Emit] = None) -> relax.Expr:
    """sqrt(replicated + the pieces' sum over tp), added over pp first when ``clip`` says so:
    the norm from this rank's sums (each already reduced over dp under ZeRO)."""
    emit = bb.emit if emit is None else emit
    op = relax.op
    squares = replicated if pieces is None else emit(op.add(replicated, emit(tp_reduce(pieces))))
    if clip.across_pp:  # this pp rank's stages: added over the pp group
        squares = emit(op.ccl.allreduce(squares, "sum"))
    return emit(op.sqrt(squares))


def clip_coefficient(bb: relax.BlockBuilder, norm: relax.Expr, max_norm: float,
                     emit: Optional[Emit] = None) -> relax.Expr:
    """min(1, max_norm / (norm + 1e-6)), 0-d float32."""
    emit = bb.emit if emit is None else emit
    op = relax.op
    coef = emit(op.divide(relax.const(float(max_norm), "float32"),
                          emit(op.add(norm, relax.const(EPS, "float32")))))
    return emit(op.minimum(coef, relax.const(1.0, "float32")))


def scaled(bb: relax.BlockBuilder, grad: relax.Expr, coef: relax.Expr,
           emit: Optional[Emit] = None) -> relax.Expr:
    """``grad * coef`` in the gradient's dtype (float32 here: master gradients)."""
    emit = bb.emit if emit is None else emit
    if str(grad.ty.dtype) != "float32":
        coef = emit(relax.op.astype(coef, str(grad.ty.dtype)))
    return emit(relax.op.multiply(grad, coef))


def with_norm(bb: relax.BlockBuilder, loss: relax.Expr, norm: relax.Expr,
              emit: Optional[Emit] = None) -> relax.Expr:
    """The step's loss output when it clips: [loss, norm] (float32[2])."""
    emit = bb.emit if emit is None else emit
    op = relax.op
    if str(loss.ty.dtype) != "float32":
        loss = emit(op.astype(loss, "float32"))
    return emit(op.concat([emit(op.reshape(loss, [1])), emit(op.reshape(norm, [1]))], axis=0))
