"""Sequence parallelism's ops (Megatron-LM, Korthikanti et al. 2022; passes/sequence_parallel.py
puts them in a tensor-parallel forward): the sequence axis of the regions between the
tensor-parallel blocks (norms, dropout, residuals) split over the tp ranks.

- ``raf_dist.sp_reduce_scatter(x)`` (attributes ``outer``, ``parts``): x is this rank's
  partial sum (a row-parallel matmul's output, where tensor parallelism has g); the sum over
  the tp ranks, this rank's chunk of the sequence. Gradient: ``sp_all_gather`` of the output
  gradient (Megatron's ``reduce_scatter_to_sequence_parallel_region``).
- ``raf_dist.sp_all_gather(x)`` (``outer``, ``parts``, ``reduce``): the chunks of every tp rank
  concatenated along ``axis`` (where tensor parallelism has f, before a column-parallel
  matmul). Gradient: with ``reduce`` the gradient is each rank's partial (a tp region reads
  the gathered value): ``sp_reduce_scatter``; without (the forward's output, every rank's
  loss the same): this rank's chunk (``sp_split``) (Megatron's
  ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=...)``).
- ``raf_dist.sp_split(x)`` (``outer``, ``parts``): this rank's chunk of a value every tp rank
  holds whole (a residual from before the first block, a position table, a dropout mask);
  gradient ``sp_all_gather`` without ``reduce`` (``scatter_to_sequence_parallel_region``).

The sequence is the middle axis of the value viewed as (outer, n, inner): ``outer`` the
batch (a (B, T, d) activation, or the importer's flattened (B * T, d): both are (B, T, d)
in this view), n the tokens; rank r's chunk is tokens ``[r n/parts, (r+1) n/parts)``. They
are lowered after autodiff by ``passes.sequence_parallel.LowerSequenceParallel(group)`` to
blocking host calls on the tp group.
"""
from typing import Any, List

import tvm
from tvm import relax

from .ops import register_op

SP_REDUCE_SCATTER = "raf_dist.sp_reduce_scatter"
SP_ALL_GATHER = "raf_dist.sp_all_gather"
SP_SPLIT = "raf_dist.sp_split"
#: the host function all three lower to (runtime/sp_kernels.py):
#: (x, kind, outer, group, out) with kind 0 reduce-scatter, 1 all-gather, 2 split
SP_KERNEL = "raf_dist.sp.exchange"
SP_OPS = (SP_REDUCE_SCATTER, SP_ALL_GATHER, SP_SPLIT)


def sequence_dim(shape: List[int], outer: int) -> int:
    """The dimension of ``shape`` holding the sequence when the value is (outer, n, inner):
    the first whose prefix product exceeds ``outer``."""
    prefix = 1
    for j, d in enumerate(shape):
        prefix *= d
        if prefix > outer:
            return j
    raise ValueError(f"a value of shape {shape} has no sequence beyond its {outer} rows")


def _resized(call: relax.Call, grow: bool) -> relax.TensorType:
    x = call.args[0]
    shape = [int(d) for d in x.ty.shape]
    outer, parts = int(call.attrs["outer"]), int(call.attrs["parts"])
    j = sequence_dim(shape, outer)
    shape[j] = shape[j] * parts if grow else shape[j] // parts
    return relax.TensorType(shape, x.ty.dtype)


def _attrs(outer: int, parts: int, reduce: bool = False) -> tvm.ir.Attrs:
    return tvm.ir.make_node("ir.DictAttrs", outer=int(outer), parts=int(parts),
                            reduce=int(bool(reduce)))


def _call(name: str, x: relax.Expr, outer: int, parts: int,
          reduce: bool = False) -> relax.Call:
    return relax.Call(_OPS[name], [x], attrs=_attrs(outer, parts, reduce))


def reduce_scatter(x: relax.Expr, outer: int, parts: int) -> relax.Call:
    return _call(SP_REDUCE_SCATTER, x, outer, parts)


def all_gather(x: relax.Expr, outer: int, parts: int, reduce: bool) -> relax.Call:
    return _call(SP_ALL_GATHER, x, outer, parts, reduce)


def split(x: relax.Expr, outer: int, parts: int) -> relax.Call:
    return _call(SP_SPLIT, x, outer, parts)


def _grad_reduce_scatter(var: Any, call: relax.Call, grad: relax.Expr, ctx: Any) -> List[Any]:
    return [all_gather(grad, int(call.attrs["outer"]), int(call.attrs["parts"]), False)]


def _grad_all_gather(var: Any, call: relax.Call, grad: relax.Expr, ctx: Any) -> List[Any]:
    outer, parts = int(call.attrs["outer"]), int(call.attrs["parts"])
    if int(call.attrs["reduce"]):
        return [reduce_scatter(grad, outer, parts)]
    return [split(grad, outer, parts)]


def _grad_split(var: Any, call: relax.Call, grad: relax.Expr, ctx: Any) -> List[Any]:
    return [all_gather(grad, int(call.attrs["outer"]), int(call.attrs["parts"]), False)]


_OPS = {
    SP_REDUCE_SCATTER: register_op(
        SP_REDUCE_SCATTER, "the sum over the tp ranks, this rank's chunk of the sequence",
        infer=lambda call, ctx: _resized(call, grow=False), gradient=_grad_reduce_scatter,
        argument="this rank's partial sum"),
    SP_ALL_GATHER: register_op(
        SP_ALL_GATHER, "the tp ranks' chunks of the sequence, concatenated",
        infer=lambda call, ctx: _resized(call, grow=True), gradient=_grad_all_gather,
        argument="this rank's chunk"),
    SP_SPLIT: register_op(
        SP_SPLIT, "this rank's chunk of the sequence of a value every tp rank holds",
        infer=lambda call, ctx: _resized(call, grow=False), gradient=_grad_split,
        argument="the whole value"),
}


def kind_of(expr: relax.Expr) -> int:
    """The host function's kind for an sp op call (0, 1, 2), or -1."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        name = str(expr.op.name)
        if name in SP_OPS:
            return SP_OPS.index(name)
    return -1
