"""What every rank of a ShardZeRO step agrees on before any update (passes/zero.py states the
contract), in one small allreduce (a sum over the dp group) once every gradient bucket is
reduced:

- the guard (``guard=True``: Trainer(nonfinite="skip") under ZeRO): each rank's "not
  finite" verdict on its gradient shards, its local parameters' gradients and its loss (the
  sums of each, as training/nonfinite.py: NaN and inf survive a sum). Their total gives
  ``all_finite``, which every update then reads, and the loss becomes NaN when it is false;
- clipping (``clip``, passes/clipping.py): this rank's sums of squares of its gradient shards
  (padding is zeros), replicated parameters apart from tensor-parallel pieces (the pieces'
  sums are added over tp too), and of its local parameters' gradients. The total gives the
  norm and the clipping coefficient; the loss becomes [loss, norm].

Both share the one allreduce, so a step with both pays one latency, not two.
"""
from typing import Any, List, Optional, Sequence, Tuple

import tvm
from tvm import relax

from . import clipping
from .bucketing import collective
from .zero_plan import Bucket

Pending = Sequence[Tuple[Bucket, relax.Var]]  # (bucket, its reduced gradient shard)


def agree(em: Any, pending: Pending
          ) -> Tuple[Optional[relax.Var], relax.Expr, Optional[relax.Var]]:
    """(all_finite, loss, clipping coefficient) once the ranks agree (module docstring), bound
    through ``em``, the ShardZeRO emitter (zero._Emitter, which imports this module):
    ``all_finite`` is None without the guard, the coefficient None without clipping; the loss
    is the emitter's, guarded and with the norm as they apply."""
    op, dtype = relax.op, "float32"
    loss: relax.Expr = em.loss
    all_finite: Optional[relax.Var] = None
    parts = []
    if em.guard:  # the reduced shards and this rank's own tables' gradients
        flag = _local_finite(em, loss, [out for _, out in pending] + em.local.gradients())
        parts.append(em.bind("not_finite", op.where(flag, relax.const(0.0, dtype),
                                                    relax.const(1.0, dtype))))
    if em.clip is not None:
        replicated, pieces = _local_squares(em, pending)
        for i, term in enumerate(em.local.squares()):
            replicated = em.bind(f"with_local_squares{i}", relax.op.add(replicated, term))
        parts.extend([replicated, pieces])
    name = "not_finite" if len(parts) == 1 else "agree"  # (the guard alone: its own names)
    vector = (em.bind("not_finite_1", op.reshape(parts[0], [1])) if len(parts) == 1
              else em.bind("agree_local", op.concat(
                  [em.bind(f"agree_part{i}", op.reshape(p, [1]))
                   for i, p in enumerate(parts)], axis=0)))
    total = em.alloc(f"{name}_total", len(parts), dtype)  # no pass can fold it away
    em.seg.bind(f"allreduce_{name}", collective(
        "raf_dist.ccl.allreduce", vector, tvm.ir.StringImm("sum"), em.group, total),
        dataflow=False)
    values = ([em.bind("not_finite_all", op.reshape(total, []))] if len(parts) == 1 else
              [em.bind(f"agreed{i}", op.reshape(em.bind(
                  f"agreed{i}_1", op.strided_slice(total, [0], [i], [i + 1])), []))
               for i in range(len(parts))])
    if em.guard:
        all_finite = em.bind("all_finite", op.less(values.pop(0), relax.const(0.5, dtype)))
        loss = em.bind("guarded_loss", op.where(
            all_finite, loss, relax.const(float("nan"), str(loss.ty.dtype))))
    if em.clip is None:
        return all_finite, loss, None
    replicated, pieces = values
    norm = clipping.norm_of(em.seg.builder, replicated,
                            pieces if em.clip.any_split else None, em.clip,
                            emit=em.binder("grad_norm"))
    coef = clipping.clip_coefficient(em.seg.builder, norm, em.clip.max_norm,
                                     emit=em.binder("clip_coef"))
    loss = clipping.with_norm(em.seg.builder, loss, norm, emit=em.binder("loss_and_norm"))
    return all_finite, loss, coef


def _local_finite(em: Any, loss: relax.Expr, shards: Sequence[relax.Var]) -> relax.Var:
    """This rank's verdict: its gradient shards and loss are finite (NaN and inf survive a
    sum)."""
    op = relax.op
    flag = em.bind("loss_finite", op.isfinite(loss))
    for i, shard in enumerate(shards):  # (bind takes one op at a time)
        if str(shard.ty.dtype) != "float32":  # TVM has no 16-bit isfinite
            shard = em.bind(f"shard_wide{i}", op.astype(shard, "float32"))
        total = em.bind(f"shard_sum{i}", op.sum(shard))
        finite = em.bind(f"shard_finite{i}", op.isfinite(total))
        flag = em.bind(f"finite{i}", op.logical_and(flag, finite))
    return flag


def _local_squares(em: Any, pending: Pending) -> List[relax.Expr]:
    """[replicated, tensor-parallel pieces]: this rank's sums of squares of its gradient
    shards (padding is zeros), by how the parameters are held across tp."""
    assert em.clip is not None
    replicated: List[relax.Expr] = []
    pieces: List[relax.Expr] = []
    for bucket, out in pending:
        # 0 / 1: replicated / tensor-parallel piece; None: counted on another pp rank
        kinds = [em.clip.kind(k) for k in bucket.keys]
        if len(set(kinds)) == 1:  # the whole bucket held alike
            if kinds[0] is not None:
                (pieces if kinds[0] else replicated).append(out)
            continue
        shards = em.split_shards(f"squares{bucket.index}", bucket, out)
        for kind, shard in zip(kinds, shards):
            if kind is not None:
                (pieces if kind else replicated).append(shard)
    zero = relax.const(0.0, "float32")
    return [clipping.squares_by_kind(em.seg.builder, group, emit=em.binder(name))[0]
            if group else zero
            for name, group in (("squares", replicated), ("squares_tp", pieces))]
