"""Pooled lookups of sharded tables: an ``nn.EmbeddingBag``'s bags summed on the rank that
holds the rows, so pooled vectors travel instead of rows (DLRM's and torchrec's exchange).

The frontend captures a bag as ``matmul(permute_dims(M, [1, 0]), take(W, ids) [* w])``
(frontend/torch_ops.py ``_embedding_bag``): M is the (ids, bags) membership, 1 where id l
belongs to bag b, built as ``astype(equal(bag_of[:, None], arange(bags)[None, :]))`` and-ed
with the padding mask; w the per-sample weights. ``find_pooled`` recognises that shape (and
nothing looser: a row of M must be one-hot or zero, which the ``equal`` against an arange
guarantees, and the bag numbers are read off it) where the rows feed nothing but the
pooling. ``pooled_lookup`` then sends, per id,
the id and its bag's number (``bag_of[l]``, -1 for a padding id: one int32
(ids, 2) exchange) and the weights (one float exchange, if any), and the holder adds each
row into its sender's bag (one scatter-add, ``grad.take_backward``; its gradient is the
gather, training/gradients.py) and sends back one (bags, dim) block per
rank; row-wise, each holder's block is a partial sum of its rows and the asking rank adds the
N blocks (torchrec's reduce-scatter of pooled partial sums). The backward is the exchanges'
reverse (their registered gradient) and the scatter-add's and take's own gradients on the
holder.

Bytes per lookup of L ids in B bags of dim D, per other holder / rank: 8 L (+ 4 L weighted)
out, 4 B D back and 4 B D of gradient, against 4 L out and 8 L D unpooled.
"""
import dataclasses
from typing import Dict, Optional, Sequence

import tvm
from tvm import relax

from ..ir.ops import ep_exchange

_OPS = {name: tvm.ir.Op.get(f"relax.{name}") for name in (
    "take", "matmul", "permute_dims", "multiply", "expand_dims", "astype", "equal",
    "logical_and", "arange")}


@dataclasses.dataclass(frozen=True)
class PooledSite:
    """One bag pooling of a table's rows (module docstring): ``out = matmul(permute_dims(
    member), rows)`` with ``rows = take(table, ids)`` or ``take(...) * expand_dims(weights,
    1)`` (``scaled``: that product's binding)."""

    table: relax.Var
    ids: relax.Expr
    member: relax.Expr
    weights: Optional[relax.Expr]
    bag_of: relax.Expr  # the bag number of each id (equal's left side)
    keep: Optional[relax.Expr]  # the ids counted (the padding mask), if any
    take: relax.Var
    scaled: Optional[relax.Var]
    out: relax.Var


def _is(value, name):
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
        and value.op.same_as(_OPS[name])


def _one_hot_rows(member, value_of):
    """(bag_of, keep or None) when ``member`` is astype(equal(bag_of[:, None],
    arange(0, bags)[None, :]) [and keep[:, None]]) (each row one-hot or zero), else None."""
    cast = value_of(member)
    if not _is(cast, "astype"):
        return None
    test, keep = value_of(cast.args[0]), None
    if _is(test, "logical_and"):
        mask = value_of(test.args[1])
        if not (_is(mask, "expand_dims") and [int(a) for a in mask.attrs.axis] == [1]):
            return None
        test, keep = value_of(test.args[0]), mask.args[0]
    if not _is(test, "equal"):
        return None
    left, right = value_of(test.args[0]), value_of(test.args[1])
    numbers = value_of(right.args[0]) if _is(right, "expand_dims") else None
    if not (_is(left, "expand_dims") and [int(a) for a in left.attrs.axis] == [1]
            and _is(numbers, "arange") and int(value_of(numbers.args[0]).value) == 0
            and int(value_of(numbers.args[2]).value) == 1):
        return None
    return left.args[0], keep


def find_pooled(func: relax.Function, tables: Sequence[relax.Var]) -> Dict[relax.Var, PooledSite]:
    """{the pooling's output var: its site} of every bag pooling of a table of ``tables`` in
    ``func`` whose looked-up rows feed nothing else."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    bound = {b.var: b.value for b in bindings}
    uses: Dict[relax.Var, int] = {}
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            uses[v] = uses.get(v, 0) + 1
    for v in relax.analysis.free_vars(func.body.body):
        uses[v] = uses.get(v, 0) + 1

    def value_of(expr):
        return bound.get(expr, expr) if isinstance(expr, relax.Var) else expr

    wanted = set(tables)
    sites = {}
    for b in bindings:
        value = b.value
        if not _is(value, "matmul"):
            continue
        left, rows = value_of(value.args[0]), value.args[1]
        if not (_is(left, "permute_dims") and [int(a) for a in left.attrs.axes] == [1, 0]
                and isinstance(rows, relax.Var) and uses.get(rows) == 1):
            continue
        scaled, weights, take = None, None, rows
        product = bound.get(rows)
        if _is(product, "multiply"):
            first, second = product.args
            for t, w in ((first, second), (second, first)):
                expanded = value_of(w)
                if (isinstance(t, relax.Var) and uses.get(t) == 1
                        and _is(bound.get(t), "take") and _is(expanded, "expand_dims")
                        and [int(a) for a in expanded.attrs.axis] == [1]):
                    scaled, take, weights = rows, t, expanded.args[0]
                    break
            else:
                continue
        looked = bound.get(take)
        if not (_is(looked, "take") and isinstance(looked.args[0], relax.Var)
                and looked.args[0] in wanted and int(looked.attrs.axis) == 0
                and len(looked.args[1].ty.shape) == 1):
            continue
        bags = _one_hot_rows(left.args[0], value_of)
        if bags is None:
            continue
        sites[b.var] = PooledSite(looked.args[0], looked.args[1], left.args[0], weights,
                                  bags[0], bags[1], take, scaled, b.var)
    return sites


def pooled_lookup(bb: relax.BlockBuilder, plan, name: str, rank: int, table: relax.Var,
                  ids: relax.Expr, member: relax.Expr, weights: Optional[relax.Expr],
                  bag_of: relax.Expr, keep: Optional[relax.Expr]) -> relax.Expr:
    """The (bags, dim) pooled vectors ``member^T (table[ids] [* weights])`` of the full table,
    pooled on the table's holders (module docstring)."""
    op = relax.op
    count = int(ids.ty.shape[0])
    bags = int(member.ty.shape[1])
    dim, dtype = int(plan.shapes[name][1]), str(table.ty.dtype)
    holders, world = plan.holders(name), plan.world
    index = "int32" if int(plan.shapes[name][0]) < 2**31 else "int64"
    # the bag of each id, -1 for an id in no bag (padding)
    key = bb.emit(op.astype(bag_of, index))
    if keep is not None:
        key = bb.emit(op.where(keep, key, relax.const(-1, index)))
    pairs = bb.emit(op.stack([op.astype(ids, index), key], axis=1))  # (count, 2)
    send = [count if j in holders else 0 for j in range(world)]
    recv = [count] * world if rank in holders else [0] * world
    tiled = bb.emit(op.tile(pairs, [len(holders), 1])) if len(holders) > 1 else pairs
    got = bb.emit(ep_exchange(tiled, send, recv))  # (world * count, 2) on a holder
    got_ids = bb.emit(op.squeeze(op.strided_slice(got, [1], [0], [1]), [1]))
    got_keys = bb.emit(op.squeeze(op.strided_slice(got, [1], [1], [2]), [1]))
    if plan.mode == "row":  # ids outside this rank's block: zero rows (a partial sum)
        begin = plan.row_range(name, rank)[0] if rank in holders else 0
        local = bb.emit(op.subtract(got_ids, relax.const(begin, index)))
        inside = bb.emit(op.logical_and(op.greater_equal(local, relax.const(0, index)),
                                        op.less(local, relax.const(plan.block_rows(name),
                                                                   index))))
        safe = bb.emit(op.where(inside, local, relax.const(0, index)))
        rows = bb.emit(op.multiply(op.take(table, safe, axis=0),
                                   op.expand_dims(op.astype(inside, dtype), 1)))
    else:
        rows = bb.emit(op.take(table, got_ids, axis=0))
    if weights is not None:
        w = bb.emit(op.tile(weights, [len(holders)])) if len(holders) > 1 else weights
        got_w = bb.emit(ep_exchange(w, send, recv))
        rows = bb.emit(op.multiply(rows, op.expand_dims(got_w, 1)))
    if rank in holders:  # each sender's bags pooled by one scatter-add of the rows
        # (sender s's id in bag b adds into row s * bags + b; a padding id into a spare last
        # row, dropped): O(ids x dim), where a (bags, ids) membership matmul per sender was
        # O(bags x ids x dim) and grew with the square of the batch
        sender = bb.emit(op.repeat(op.arange(0, world, 1, index), count, axis=0))
        slot = bb.emit(op.add(op.multiply(sender, relax.const(bags, index)), got_keys))
        slot = bb.emit(op.where(op.less(got_keys, relax.const(0, index)),
                                relax.const(world * bags, index), slot))
        sums = bb.emit(relax.op.grad.take_backward(
            rows, op.zeros((world * bags + 1, dim), dtype), slot, axis=0))
        outgoing = bb.emit(op.strided_slice(sums, [0], [0], [world * bags]))
    else:  # nothing to pool: the (0, dim) rows keep this rank's half of the exchange alive
        outgoing = rows
    back_send = [bags] * world if rank in holders else [0] * world
    back_recv = [bags if j in holders else 0 for j in range(world)]
    back = bb.emit(ep_exchange(outgoing, back_send, back_recv))  # (holders * bags, dim)
    if len(holders) > 1:
        back = bb.emit(op.sum(op.reshape(back, [len(holders), bags, dim]), axis=[0]))
    return back


def pooled_exchange_bytes(plan, rank: int, name: str, ids: int, bags: int, weighted: bool,
                          id_bytes: int = 4, row_bytes: int = 4) -> int:
    """The bytes rank ``rank`` sends to other ranks in one step for one pooled lookup of
    ``ids`` ids in ``bags`` bags (forward: the (id, key) pairs and the weights to each other
    holder, the pooled blocks back from a holder; backward: their gradients to each other
    holder)."""
    others = [h for h in plan.holders(name) if h != rank]
    dim = int(plan.shapes[name][1])
    total = len(others) * ids * (2 * id_bytes + (row_bytes if weighted else 0))
    if rank in plan.holders(name):
        total += (plan.world - 1) * bags * dim * row_bytes
    return total + len(others) * bags * dim * row_bytes

