"""The host kernels of the attention op (ir/attention.py), on the step's own memory
through DLPack (zero copy in, one copy of each result into the buffer the VM gave).

On the CPU: PyTorch's flash attention (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward; why these: ir/attention.py), on PyTorch's OpenMP team with the
threads runtime/blas.py gives it. Elsewhere (a CUDA tensor) and for what the CPU kernel
refuses: ``blockwise_forward`` / ``blockwise_backward`` below, FlashAttention-2's algorithm
in PyTorch ops over blocks of ``BLOCK`` queries (each block's scores, never T x T: the
memory is O(BLOCK x Tk)), which tests/unit/test_attention.py checks against the CPU kernel
and against PyTorch's autograd. The CUDA leg has not run on a GPU (docs/design-notes.md).
"""
from typing import Any, Optional, Tuple

import tvm_ffi

from ..ir.ops import ATTENTION_BACKWARD_KERNEL, ATTENTION_FORWARD_KERNEL
from . import blas

#: queries per block of the blockwise path
BLOCK = 256


def _mask(torch: Any, mask: Any, dtype: Any) -> Optional[Any]:
    """The additive mask as a 4-d tensor of ``dtype`` (a 0-d placeholder: None)."""
    m = torch.from_dlpack(mask)
    if m.dim() == 0:
        return None
    while m.dim() < 4:
        m = m.unsqueeze(0)
    return m if m.dtype == dtype else m.to(dtype)


def _causal_block(torch: Any, start: int, rows: int, tk: int, device: Any) -> Any:
    """The additive causal mask of queries start .. start + rows against tk keys (top-left
    aligned, as PyTorch's is_causal)."""
    i = torch.arange(start, start + rows, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    return torch.zeros((rows, tk), device=device).masked_fill(j > i, float("-inf"))


def _grouped(t: Any, heads: int) -> Any:
    """Key / value heads repeated to the query heads (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _scores(torch: Any, q: Any, k: Any, start: int, mask: Optional[Any], causal: bool,
            scale: float) -> Any:
    """Float32 scores of the query block starting at ``start`` against every key."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:  # its query axis broadcast, or this block's rows of it
        s = s + (mask[:, :, start:start + q.shape[2]] if mask.shape[2] > 1 else mask).float()
    if causal:
        s = s + _causal_block(torch, start, q.shape[2], k.shape[2], q.device)
    return s


def blockwise_forward(torch: Any, q: Any, k: Any, v: Any, mask: Optional[Any], causal: bool,
                      scale: float) -> Tuple[Any, Any]:
    """(output in q's dtype, float32 log-sum-exp (B, H, Tq)), one block of queries at a time
    (a row whose every key is masked gets output 0, as PyTorch's flash kernel gives)."""
    heads = q.shape[1]
    k, v = _grouped(k, heads), _grouped(v, heads)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[2], BLOCK):
        s = _scores(torch, q[:, :, start:start + BLOCK], k, start, mask, causal, scale)
        m = s.amax(-1, keepdim=True).clamp_min(-3.4e38)  # finite for fully masked rows
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        out[:, :, start:start + BLOCK] = (torch.matmul(p, v.float())
                                          / total.clamp_min(1e-38)).to(q.dtype)
        # a row whose every key is masked (-inf): output 0 and log-sum-exp 0, as PyTorch's
        # kernel gives, so the backward's exp(s - lse) is 0 there, not exp(-inf + inf)
        lse[:, :, start:start + BLOCK] = torch.where(
            total > 0, m + torch.log(total), torch.zeros_like(total)).squeeze(-1)
    return out, lse


def blockwise_backward(torch: Any, grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                       mask: Optional[Any], causal: bool, scale: float) -> Tuple[Any, Any, Any]:
    """(dq, dk, dv) from the output, its gradient and the log-sum-exp (FlashAttention-2's
    backward: P recomputed per block from the saved statistics)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kg, vg = _grouped(k, heads).float(), _grouped(v, heads).float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kg.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vg.shape, dtype=torch.float32, device=q.device)
    delta = (grad.float() * out.float()).sum(-1, keepdim=True)  # D_i = rowsum(dO * O)
    for start in range(0, q.shape[2], BLOCK):
        rows = slice(start, start + BLOCK)
        qb, gb = q[:, :, rows].float(), grad[:, :, rows].float()
        s = _scores(torch, qb, kg, start, mask, causal, scale)
        p = torch.exp(s - lse[:, :, rows].unsqueeze(-1))
        dv += torch.matmul(p.transpose(-1, -2), gb)
        ds = p * (torch.matmul(gb, vg.transpose(-1, -2)) - delta[:, :, rows]) * scale
        dq[:, :, rows] = torch.matmul(ds, kg)
        dk += torch.matmul(ds.transpose(-1, -2), qb)
    if kv_heads != heads:  # each key/value head's gradient sums its query heads'
        group = heads // kv_heads
        dk = dk.view(dk.shape[0], kv_heads, group, *dk.shape[2:]).sum(2)
        dv = dv.view(dv.shape[0], kv_heads, group, *dv.shape[2:]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cpu_kernel(q: Any, v: Any) -> bool:
    """Whether PyTorch's CPU flash kernel takes the operands: CPU tensors with one head size
    for q, k and v (it refuses a value head size of its own: "Q/K/V should have the same head
    size"; _mask gave the mask their dtype, as it requires)."""
    return bool(q.device.type == "cpu" and q.shape[-1] == v.shape[-1])


def forward(q: Any, k: Any, v: Any, mask: Any, causal: int, scale: float, out: Any,
            lse: Any) -> None:
    torch = blas.torch_module()
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    m = _mask(torch, mask, tq.dtype)
    if _cpu_kernel(tq, tv):
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            tq, tk, tv, 0.0, bool(causal), attn_mask=m, scale=float(scale))
    else:
        o, l = blockwise_forward(torch, tq, tk, tv, m, bool(causal), float(scale))
    torch.from_dlpack(out).copy_(o)
    torch.from_dlpack(lse).copy_(l)


def backward(grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any, causal: int,
             scale: float, dq: Any, dk: Any, dv: Any) -> None:
    torch = blas.torch_module()
    tg, tq, tk, tv, to, tl = (torch.from_dlpack(x) for x in (grad, q, k, v, out, lse))
    m = _mask(torch, mask, tq.dtype)
    if _cpu_kernel(tq, tv):
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            tg, tq, tk, tv, to, tl, 0.0, bool(causal), attn_mask=m, scale=float(scale))
    else:
        gq, gk, gv = blockwise_backward(torch, tg, tq, tk, tv, to, tl, m, bool(causal),
                                        float(scale))
    for dst, src in ((dq, gq), (dk, gk), (dv, gv)):
        torch.from_dlpack(dst).copy_(src)


tvm_ffi.register_global_func(ATTENTION_FORWARD_KERNEL, forward, override=True)
tvm_ffi.register_global_func(ATTENTION_BACKWARD_KERNEL, backward, override=True)
