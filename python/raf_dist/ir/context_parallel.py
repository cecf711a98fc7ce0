"""Context parallelism's ops (DESIGN.md section 1, "Long sequences"; passes/context_parallel.py
puts them in a forward whose sequence is split over the cp ranks).

- ``raf_dist.cp_positions(like)`` (attributes ``seq``, ``cp``, ``balanced``): the global
  positions of this rank's ``seq / cp`` tokens, a 1-d int64 tensor. ``balanced`` (the ring):
  rank r holds chunks r and 2cp-1-r of 2cp equal chunks (causal load balance: every rank
  gets as many unmasked query-key pairs); otherwise chunk r of cp. The IR is the same on
  every rank: the runtime answers from the rank's place in its cp group
  (runtime/cp_kernels.py). No gradient (integers).
- ``raf_dist.cp_attention(q, k, v)`` (attributes ``causal``, ``scale``, ``method``): the
  attention op of ir/attention.py over the whole sequence when q, k and v hold this rank's
  tokens (B, H, T/cp, D): ``method`` "ring" passes key/value blocks round the cp group,
  "alltoall" (Ulysses) exchanges sequence shards for head shards and back. Returns (O, L)
  for this rank's queries, as the attention op does.
- ``raf_dist.cp_attention_grad(dO, q, k, v, O, L)``: its gradients (dq, dk, dv) for this
  rank's tokens; the ring passes dK / dV round the group back to their owners.

Each is lowered after autodiff by ``passes.context_parallel.LowerContextParallel(group)`` to a
blocking host call on the cp group (never dropped or reordered: every rank of the group
runs them in the same order).
"""
from typing import Any, List

import tvm
from tvm import relax
from tvm.relax.op.base import register_gradient

from .ops import GRADIENT_LEVEL, register_op

CP_POSITIONS = "raf_dist.cp_positions"
CP_ATTENTION = "raf_dist.cp_attention"
CP_ATTENTION_GRAD = "raf_dist.cp_attention_grad"
#: the runtime functions they lower to (runtime/cp_kernels.py)
CP_POSITIONS_FUNC = "raf_dist.cp.positions"
CP_ATTENTION_FORWARD_KERNEL = "raf_dist.cp.attention_forward"
CP_ATTENTION_BACKWARD_KERNEL = "raf_dist.cp.attention_backward"
METHODS = ("ring", "alltoall")


def _positions_type(call: relax.Call, ctx: Any) -> relax.TensorType:
    return relax.TensorType([int(call.attrs["seq"]) // int(call.attrs["cp"])], "int64")


def _forward_type(call: relax.Call, ctx: Any) -> relax.TupleType:
    q, v = call.args[0], call.args[2]
    shape = list(q.ty.shape)
    return relax.TupleType([relax.TensorType(shape[:-1] + [v.ty.shape[-1]], q.ty.dtype),
                            relax.TensorType(shape[:-1], "float32")])


def _backward_type(call: relax.Call, ctx: Any) -> relax.TupleType:
    return relax.TupleType([call.args[1].ty, call.args[2].ty, call.args[3].ty])


_POSITIONS = register_op(
    CP_POSITIONS, "the global positions of this cp rank's tokens (1-d int64)",
    argument="any tensor on the step's device", infer=_positions_type,
    gradient=lambda var, call, grad, ctx: [relax.op.zeros_like(call.args[0])])
_FORWARD = register_op(
    CP_ATTENTION, "attention over the whole sequence from this cp rank's tokens",
    arguments=[("q", "this rank's queries (B, H, T/cp, D)"), ("k", "its keys"),
               ("v", "its values")], infer=_forward_type)
_BACKWARD = register_op(
    CP_ATTENTION_GRAD, "the gradients of raf_dist.cp_attention for this rank's tokens",
    arguments=[("output_grad", "the output's gradient"), ("q", "queries"), ("k", "keys"),
               ("v", "values"), ("output", "the forward's output"),
               ("logsumexp", "the forward's log-sum-exp (float32)")], infer=_backward_type)


def positions(like: relax.Expr, seq: int, cp: int, balanced: bool) -> relax.Call:
    attrs = tvm.ir.make_node("ir.DictAttrs", seq=int(seq), cp=int(cp),
                             balanced=int(bool(balanced)))
    return relax.Call(_POSITIONS, [like], attrs=attrs)


def cp_attention(q: relax.Expr, k: relax.Expr, v: relax.Expr, causal: bool, scale: float,
                 method: str, cp: int) -> relax.Call:
    """The cp attention of this rank's q, k, v over ``cp`` ranks; ``scale`` resolved (not
    0)."""
    if method not in METHODS:
        raise ValueError(f"context_parallel_method must be one of {METHODS}, got {method!r}")
    attrs = tvm.ir.make_node("ir.DictAttrs", causal=int(bool(causal)), scale=float(scale),
                             method=method, cp=int(cp))
    return relax.Call(_FORWARD, [q, k, v], attrs=attrs)


def flops(call: relax.Call) -> int:
    """This rank's FLOPs of a cp attention call (or its gradient), counted as the attention
    op's (ir/attention.py: as PyTorch's flop counter): its queries against the whole
    sequence's keys."""
    backward = call.op == _BACKWARD
    q, v = call.args[1 if backward else 0], call.args[3 if backward else 2]
    b, h, tq, d = (int(x) for x in q.ty.shape)
    tk, dv = int(v.ty.shape[2]) * int(call.attrs["cp"]), int(v.ty.shape[3])
    forward = 2.0 * b * h * tq * tk * (d + dv)
    return int(2 * forward if backward else forward)


def is_op(expr: relax.Expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and \
        expr.op.name == name


def _gradient(var: relax.Var, call: relax.Call, grad: relax.Expr,
              ctx: Any) -> List[relax.Expr]:
    q, k, v = call.args
    grads = relax.Call(_BACKWARD, [relax.TupleGetItem(grad, 0), q, k, v,
                                   relax.TupleGetItem(var, 0), relax.TupleGetItem(var, 1)],
                       attrs=call.attrs)
    return [relax.TupleGetItem(grads, i) for i in range(3)]


register_gradient(CP_ATTENTION, _gradient, level=GRADIENT_LEVEL)
