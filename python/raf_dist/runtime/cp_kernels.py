"""The host side of context parallelism's ops (ir/context_parallel.py): this rank's positions,
and attention over a sequence split across the cp group, forward and backward, on the step's
own memory through DLPack.

**Ring** (``method`` "ring"; Liu et al. 2023, torchtitan / Megatron's context_parallel):
rank r holds the queries, keys and values of chunks r and 2c-1-r of 2c (``positions``). The
key/value blocks travel round the group (rank r sends to r+1, receives from r-1; the next
block's transfer is posted before this block's work, so it proceeds on the communication
thread while the kernels run). For each pair of (query chunk, key chunk) the block kernel
of runtime/attention_kernels.py runs: whole when the key chunk comes before the query chunk,
causal on the diagonal, skipped when it comes after (causal); the partial outputs merge by
their log-sum-exps (the online softmax across blocks), in float32. The backward runs the
block kernels' backward with the global output and log-sum-exp (FlashAttention-2's
backward needs nothing else), accumulates dQ locally and passes dK / dV (float32) round the
ring with their blocks; after c steps they reach their owners.

**All-to-all** (``method`` "alltoall", DeepSpeed-Ulysses): rank r holds chunk r of c. An
all-to-all turns (B, H, T/c, D) sequence shards into (B, H/c, T, D) head shards, the
attention op's kernel runs on the whole sequence for H/c heads, and a second all-to-all
brings the output back; the backward does the same with the gradients.

The communication is raf_dist.ccl's (MPI for host tensors, NCCL for GPU ones), so stats()
counts it (send / recv, alltoall bytes). The GPU leg has not run on a GPU.
"""
from typing import Any, List, Tuple

import tvm
import tvm_ffi

from .. import _native
from ..ir.context_parallel import (CP_ATTENTION_BACKWARD_KERNEL, CP_ATTENTION_FORWARD_KERNEL,
                                   CP_POSITIONS_FUNC)
from ..training.context_parallel import positions
from . import attention_kernels as kernels
from . import blas


def _positions_tensor(like: Any, group: int, seq: int, balanced: int) -> Any:
    rank, size = (int(_native.func(f)(int(group))) for f in ("group_rank", "group_size"))
    return tvm.runtime.tensor(positions(int(seq), size, rank, "ring" if balanced else "alltoall"), device=like.device)


# ---- point to point and all-to-all on torch tensors ------------------------------------------
def _ffi(t: Any) -> Any:
    return tvm_ffi.from_dlpack(t)


def _exchange(send: Any, recv: Any, group: int, nxt: int, prev: int) -> Tuple[int, int]:
    """Post: ``send`` to group rank ``nxt``, ``recv`` filled from ``prev`` (handles)."""
    return (_native.func("send_start")(_ffi(send), nxt, group),
            _native.func("recv_start")(prev, group, _ffi(recv)))


def _wait(handles: Tuple[int, int]) -> None:
    for h in handles:
        _native.func("wait")(h)


def _alltoall(torch: Any, blocks: Any, group: int) -> Any:
    """Block j of ``blocks`` (leading axis: one per rank) to rank j; block j of the result
    from rank j."""
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    _native.func("alltoall")(_ffi(blocks.view(-1)), group, _ffi(out.view(-1)))
    return out


def _to_heads(torch: Any, x: Any, c: int, group: int) -> Any:
    """(B, H, T/c, ...) sequence shard -> (B, H/c, T, ...) head shard."""
    b, h, t = x.shape[:3]
    rest = tuple(x.shape[3:])
    blocks = x.reshape((b, c, h // c, t) + rest).movedim(1, 0)
    got = _alltoall(torch, blocks, group)  # (c: source rank = its chunk, B, H/c, T/c, ...)
    return got.movedim(0, 2).reshape((b, h // c, c * t) + rest)


def _to_sequence(torch: Any, y: Any, c: int, group: int) -> Any:
    """(B, H/c, T, ...) head shard -> (B, H, T/c, ...) sequence shard."""
    b, h, t = y.shape[:3]
    rest = tuple(y.shape[3:])
    blocks = y.reshape((b, h, c, t // c) + rest).movedim(2, 0)
    got = _alltoall(torch, blocks, group)  # (c: source rank = its heads, B, H/c, T/c, ...)
    return got.movedim(0, 1).reshape((b, c * h, t // c) + rest)


# ---- block kernels ----------------------------------------------------------------------------
def _block_forward(torch: Any, q: Any, k: Any, v: Any, causal: bool, scale: float) -> Any:
    if kernels._cpu_kernel(q, v):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, 0.0, causal, scale=scale)[:2]
        return o, lse
    return kernels.blockwise_forward(torch, q, k, v, None, causal, scale)


def _block_backward(torch: Any, g: Any, q: Any, k: Any, v: Any, o: Any, lse: Any,
                    causal: bool, scale: float) -> Any:
    if kernels._cpu_kernel(q, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            g, q, k, v, o, lse, 0.0, causal, scale=scale)
    return kernels.blockwise_backward(torch, g, q, k, v, o, lse, None, causal, scale)


def _pair(query_chunk: int, key_chunk: int, causal: bool) -> Any:
    """None (skip), False (whole) or True (causal diagonal) for a pair of chunks."""
    if not causal or key_chunk < query_chunk:
        return False
    return True if key_chunk == query_chunk else None


def _chunks(t: Any) -> List[Any]:
    half = t.shape[2] // 2
    return [t[:, :, :half], t[:, :, half:]]


def _ring_forward(torch: Any, q: Any, k: Any, v: Any, causal: bool, scale: float,
                  group: int) -> Tuple[Any, Any]:
    r, c = (int(_native.func(f)(group)) for f in ("group_rank", "group_size"))
    mine = (r, 2 * c - 1 - r)
    qs = _chunks(q)
    out = [torch.zeros(x.shape[:-1] + v.shape[-1:], dtype=torch.float32) for x in qs]
    lse = [torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32) for x in qs]
    split = k.numel()
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    for step in range(c):
        src = (r - step) % c
        pending = None
        if step < c - 1:
            nxt = torch.empty_like(kv)
            pending = _exchange(kv, nxt, group, (r + 1) % c, (r - 1) % c)
        kb, vb = kv[:split].view(k.shape), kv[split:].view(v.shape)
        for a, qa in enumerate(qs):
            for key_chunk, kc, vc in zip((src, 2 * c - 1 - src), _chunks(kb), _chunks(vb)):
                mode = _pair(mine[a], key_chunk, causal)
                if mode is None:
                    continue
                o, l = _block_forward(torch, qa.contiguous(), kc.contiguous(), vc.contiguous(), mode, scale)
                merged = torch.logaddexp(lse[a], l.float())
                out[a] = (out[a] * torch.exp(lse[a] - merged).unsqueeze(-1)
                          + o.float() * torch.exp(l.float() - merged).unsqueeze(-1))
                lse[a] = merged
        if pending is not None:
            _wait(pending)
            kv = nxt
    return torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)


def _ring_backward(torch: Any, g: Any, q: Any, k: Any, v: Any, o: Any, lse: Any,
                   causal: bool, scale: float, group: int) -> Tuple[Any, Any, Any]:
    r, c = (int(_native.func(f)(group)) for f in ("group_rank", "group_size"))
    mine = (r, 2 * c - 1 - r)
    qs, gs, os_, ls = _chunks(q), _chunks(g), _chunks(o), _chunks(lse.unsqueeze(-1))
    dq = [torch.zeros(x.shape, dtype=torch.float32) for x in qs]
    split = k.numel()
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    dkv = torch.zeros(kv.numel(), dtype=torch.float32)  # travels with its block
    for step in range(c):
        src = (r - step) % c
        pending = None
        if step < c - 1:  # the next block now; its gradients once this block's are in
            nxt = torch.empty_like(kv)
            pending = _exchange(kv, nxt, group, (r + 1) % c, (r - 1) % c)
        kb, vb = kv[:split].view(k.shape), kv[split:].view(v.shape)
        dk, dv = dkv[:split].view(k.shape), dkv[split:].view(v.shape)
        for a in range(2):
            for key_chunk, kc, vc, dkc, dvc in zip((src, 2 * c - 1 - src), _chunks(kb),
                                                   _chunks(vb), _chunks(dk), _chunks(dv)):
                mode = _pair(mine[a], key_chunk, causal)
                if mode is None:
                    continue
                gq, gk, gv = _block_backward(
                    torch, gs[a].contiguous(), qs[a].contiguous(), kc.contiguous(),
                    vc.contiguous(), os_[a].contiguous(), ls[a].squeeze(-1).contiguous(),
                    mode, scale)
                dq[a] += gq.float()
                dkc += gk.float()
                dvc += gv.float()
        back = torch.empty_like(dkv)
        grads = _exchange(dkv, back, group, (r + 1) % c, (r - 1) % c)
        if pending is not None:
            _wait(pending)
            kv = nxt
        _wait(grads)
        dkv = back  # after the last step: this rank's own blocks' gradients, from every rank
    return (torch.cat(dq, dim=2).to(q.dtype), dkv[:split].view(k.shape).to(k.dtype),
            dkv[split:].view(v.shape).to(v.dtype))


# ---- the registered kernels -----------------------------------------------------------------
def forward(q: Any, k: Any, v: Any, causal: int, scale: float, alltoall: int, group: int,
            out: Any, lse: Any) -> None:
    torch = blas.torch_module()
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    group = int(group)
    if alltoall:
        c = int(_native.func("group_size")(group))
        hq, hk, hv = (_to_heads(torch, t, c, group) for t in (tq, tk, tv))
        o, l = _block_forward(torch, hq, hk, hv, bool(causal), float(scale))
        o, l = _to_sequence(torch, o, c, group), _to_sequence(torch, l.float(), c, group)
    else:
        o, l = _ring_forward(torch, tq, tk, tv, bool(causal), float(scale), group)
    torch.from_dlpack(out).copy_(o)
    torch.from_dlpack(lse).copy_(l)


def backward(grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, causal: int, scale: float,
             alltoall: int, group: int, dq: Any, dk: Any, dv: Any) -> None:
    torch = blas.torch_module()
    tg, tq, tk, tv, to, tl = (torch.from_dlpack(x) for x in (grad, q, k, v, out, lse))
    group = int(group)
    if alltoall:
        c = int(_native.func("group_size")(group))
        hg, hq, hk, hv, ho, hl = (_to_heads(torch, t, c, group)
                                  for t in (tg, tq, tk, tv, to, tl))
        gq, gk, gv = _block_backward(torch, hg, hq, hk, hv, ho, hl, bool(causal),
                                     float(scale))
        gq, gk, gv = (_to_sequence(torch, t.contiguous(), c, group) for t in (gq, gk, gv))
    else:
        gq, gk, gv = _ring_backward(torch, tg, tq, tk, tv, to, tl, bool(causal), float(scale),
                                    group)
    for dst, src in ((dq, gq), (dk, gk), (dv, gv)):
        torch.from_dlpack(dst).copy_(src)


tvm_ffi.register_global_func(CP_POSITIONS_FUNC, _positions_tensor, override=True)
tvm_ffi.register_global_func(CP_ATTENTION_FORWARD_KERNEL, forward, override=True)
tvm_ffi.register_global_func(CP_ATTENTION_BACKWARD_KERNEL, backward, override=True)
