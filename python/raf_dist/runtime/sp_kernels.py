"""The host side of sequence parallelism's ops (ir/sequence_parallel.py): a reduce-scatter,
all-gather or split along one axis over the tp group, on the step's memory through DLPack.

raf_dist.ccl's reduce-scatter and all-gather work on flat buffers in rank order, so the value
is viewed as (outer, n, inner) (ir/sequence_parallel.py) and its token axis moved first (a
copy) and back after. MPI for host tensors, NCCL for GPU ones (the GPU leg has not run on a
GPU).
"""
from typing import Any

import tvm_ffi

from .. import _native
from ..ir.sequence_parallel import SP_KERNEL, sequence_dim
from . import blas


def exchange(x: Any, kind: int, outer: int, group: int, out: Any) -> None:
    torch = blas.torch_module()
    tx, to = torch.from_dlpack(x), torch.from_dlpack(out)
    group, outer = int(group), int(outer)
    parts = int(_native.func("group_size")(group))
    rank = int(_native.func("group_rank")(group))
    shape = [int(d) for d in tx.shape]
    j = sequence_dim(shape, outer)
    inner = 1
    for d in shape[j + 1:]:
        inner *= d
    tokens = tx.numel() // (outer * inner)
    lead = tx.reshape(outer, tokens, inner).movedim(1, 0).contiguous()
    axis = 1
    to = to.view(outer, -1, inner)
    if kind == 2:  # this rank's chunk
        chunk = lead.shape[0] // parts
        to.copy_(lead[rank * chunk:(rank + 1) * chunk].movedim(0, axis))
        return
    if kind == 0:  # the sum of every rank's whole, this rank's chunk of it
        got = torch.empty((lead.shape[0] // parts,) + tuple(lead.shape[1:]), dtype=lead.dtype)
        _native.func("reduce_scatter")(tvm_ffi.from_dlpack(lead.view(-1)), "sum", group,
                                       tvm_ffi.from_dlpack(got.view(-1)))
    else:  # every rank's chunk, in rank order
        got = torch.empty((lead.shape[0] * parts,) + tuple(lead.shape[1:]), dtype=lead.dtype)
        _native.func("allgather")(tvm_ffi.from_dlpack(lead.view(-1)), group,
                                  tvm_ffi.from_dlpack(got.view(-1)))
    to.copy_(got.movedim(0, axis))


tvm_ffi.register_global_func(SP_KERNEL, exchange, override=True)
