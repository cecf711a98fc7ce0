"""Scaled-dot-product attention as one op with its own backward, never holding the T x T
scores (DESIGN.md section 1, "Long sequences"; FlashAttention-2's algorithm).

``raf_dist.attention(q, k, v, mask)`` (attributes ``causal``, ``scale``) is
``softmax(q k^T * scale + mask) v`` over the last two axes of q (B, H, Tq, D), k (B, Hk, Tk, D)
and v (B, Hk, Tk, Dv), with Hk dividing H (grouped-query / multi-query attention: query head
h reads key/value head h // (H / Hk)); ``causal`` masks key j > query i (top-left aligned,
as PyTorch's ``is_causal``); ``mask`` is an additive float mask broadcast to (B, H, Tq, Tk),
or a 0-d placeholder for none. It returns (O, L): the output in q's dtype and the
log-sum-exp of each query's scores in float32 (B, H, Tq), all the backward keeps besides
q, k, v and O. ``raf_dist.attention_grad(dO, q, k, v, O, L, mask)`` returns (dq, dk, dv).

Both lower to host kernels (runtime/attention_kernels.py): PyTorch's CPU flash attention
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: blockwise over
query and key blocks with an online softmax, fully masked causal blocks skipped, float32
statistics under bf16 / fp16), called on the step's own memory through DLPack. Why these
and not a TVM kernel: measured here (2 cores, B 2, H 4, D 64, fp32, causal, forward and
backward), they take 25 / 78 / 290 ms at T = 1024 / 2048 / 4096 and hold 17 / 27 / 47 MiB
beyond their operands, where the T x T path TVM compiles today (matmul, softmax, matmul and
their gradients) holds 4 * B * H * T^2 bytes per score tensor (512 MiB at 4096) and the
same path in PyTorch took 4.3-5.8x longer; a blockwise TVM schedule that fast on the CPU
(tiling, vectorised online softmax, causal block skipping, threads) is a kernel project of
its own, and the library made for the job is here. docs/design-notes.md records it.

The frontend (frontend/torch_ops.py) captures ``F.scaled_dot_product_attention`` as this op
(the CPU export's ``_scaled_dot_product_flash_attention_for_cpu``, with transformers' sdpa
attention of GPT-2, Llama, Qwen, Mistral). Attention with dropout (dropout_p > 0 in
training) is exported by PyTorch through its math path and stays on it.
"""
import math
from typing import Any, Callable, List, Optional

import tvm
from tvm import relax
from tvm.relax.op.base import register_gradient
from tvm.relax.transform.legalize_ops.common import register_legalize

from .ops import (ATTENTION, ATTENTION_BACKWARD_KERNEL, ATTENTION_FORWARD_KERNEL,
                      ATTENTION_GRAD, GRADIENT_LEVEL, register_op)


def _shape(expr: relax.Expr) -> List[int]:
    return [int(d) for d in expr.ty.shape]


def _forward_type(call: relax.Call, ctx: Any) -> relax.TupleType:
    q, v = call.args[0], call.args[2]
    shape = list(q.ty.shape)
    return relax.TupleType([relax.TensorType(shape[:-1] + [v.ty.shape[-1]], q.ty.dtype),
                            relax.TensorType(shape[:-1], "float32")])


def _backward_type(call: relax.Call, ctx: Any) -> relax.TupleType:
    q, k, v = call.args[1], call.args[2], call.args[3]
    return relax.TupleType([q.ty, k.ty, v.ty])


_FORWARD = register_op(
    ATTENTION, "softmax(q k^T * scale + mask) v, blockwise: (output, log-sum-exp)",
    arguments=[("q", "queries (B, H, Tq, D)"), ("k", "keys (B, Hk, Tk, D)"),
               ("v", "values (B, Hk, Tk, Dv)"),
               ("mask", "additive float mask broadcast to (B, H, Tq, Tk), or 0-d: none")],
    infer=_forward_type)
_BACKWARD = register_op(
    ATTENTION_GRAD, "the gradients of raf_dist.attention with respect to q, k and v",
    arguments=[("output_grad", "the output's gradient"), ("q", "queries"), ("k", "keys"),
               ("v", "values"), ("output", "the forward's output"),
               ("logsumexp", "the forward's log-sum-exp (float32)"), ("mask", "its mask")],
    infer=_backward_type)


def attention_attrs(causal: bool, scale: Optional[float]) -> tvm.ir.Attrs:
    """The op's attributes: ``scale`` None is 1 / sqrt(D), stored as 0."""
    return tvm.ir.make_node("ir.DictAttrs", causal=int(bool(causal)),
                            scale=float(scale) if scale is not None else 0.0)


def check_shapes(q: relax.Expr, k: relax.Expr, v: relax.Expr, mask: relax.Expr) -> None:
    """ValueError naming the problem for operands the op cannot take."""
    shapes = {n: _shape(x) for n, x in (("q", q), ("k", k), ("v", v))}
    if any(len(s) != 4 for s in shapes.values()):
        raise ValueError(f"attention takes 4-d q, k, v (batch, heads, seq, dim), got {shapes}")
    (b, h, _, d), (bk, hk, tk, dk), (bv, hv, tv, _) = shapes["q"], shapes["k"], shapes["v"]
    if not (b == bk == bv and hk == hv and tk == tv and d == dk):
        raise ValueError(f"attention: q, k, v do not agree in batch, key/value heads, key "
                         f"length or head dim: {shapes}")
    if h % hk:
        raise ValueError(f"attention: {hk} key/value heads do not divide {h} query heads")
    if mask.ty.ndim > 4:  # 0-d: none; else broadcast to (B, H, Tq, Tk)
        raise ValueError(f"attention: a mask of {mask.ty.ndim} dims")


def attention(q: relax.Expr, k: relax.Expr, v: relax.Expr, mask: Optional[relax.Expr] = None,
              causal: bool = False, scale: Optional[float] = None) -> relax.Call:
    """The attention op on Relax values (a tuple: output, log-sum-exp)."""
    if mask is None:
        mask = relax.const(0.0, str(q.ty.dtype))
    check_shapes(q, k, v, mask)
    return relax.Call(_FORWARD, [q, k, v, mask], attrs=attention_attrs(causal, scale))


def is_attention(expr: relax.Expr) -> bool:
    return isinstance(expr, relax.Call) and expr.op == _FORWARD


def has_mask(call: relax.Call) -> bool:
    return call.args[3].ty.ndim != 0


def flops(call: relax.Call) -> int:
    """FLOPs (multiply-adds x 2) of an attention op's call as PyTorch's
    torch.utils.flop_counter counts scaled-dot-product attention (so that metrics() and MFU
    agree with it, and with the eager matmuls the op replaces): the forward's QK^T and PV in
    full, causal or not, and the backward's four products (dV, dP, dQ, dK), twice the
    forward. The kernel does less than this under ``causal`` (it skips the masked blocks)
    and recomputes QK^T in the backward: the count is the model's work, not the kernel's."""
    backward = call.op == _BACKWARD
    q, v = call.args[1 if backward else 0], call.args[3 if backward else 2]
    b, h, tq, d = _shape(q)
    tk, dv = _shape(v)[2], _shape(v)[3]
    forward = 2.0 * b * h * tq * tk * (d + dv)
    return int(2 * forward if backward else forward)


def _gradient(var: relax.Var, call: relax.Call, grad: relax.Expr,
              ctx: Any) -> List[relax.Expr]:
    q, k, v, mask = call.args
    output_grad = relax.TupleGetItem(grad, 0)  # the log-sum-exp's adjoint is zero
    grads = relax.Call(_BACKWARD, [output_grad, q, k, v, relax.TupleGetItem(var, 0),
                                   relax.TupleGetItem(var, 1), mask], attrs=call.attrs)
    return [relax.TupleGetItem(grads, 0), relax.TupleGetItem(grads, 1),
            relax.TupleGetItem(grads, 2), relax.op.grad.no_grad(mask)]


register_gradient(ATTENTION, _gradient, level=GRADIENT_LEVEL)


def _scale(call: relax.Call) -> float:
    """The scale, its default 1 / sqrt(D) read from q (the gradient op's second argument)."""
    scale = float(call.attrs["scale"])
    q = call.args[1] if call.op == _BACKWARD else call.args[0]
    return scale if scale else 1.0 / math.sqrt(int(q.ty.shape[-1]))


def _legalize(kernel: str) -> Callable[[relax.BlockBuilder, relax.Call], relax.Expr]:
    def lower(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        args = list(call.args) + [relax.prim_value(int(call.attrs["causal"])),
                                  relax.prim_value(tvm.tirx.FloatImm("float64", _scale(call)))]
        return relax.call_dps_packed(kernel, relax.Tuple(args), list(call.ty.fields))
    return lower


register_legalize(ATTENTION, _legalize(ATTENTION_FORWARD_KERNEL))
register_legalize(ATTENTION_GRAD, _legalize(ATTENTION_BACKWARD_KERNEL))
