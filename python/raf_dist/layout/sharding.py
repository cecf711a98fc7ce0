"""The padded flat dim-0 sharding of DESIGN.md section 3, in one place.

A tensor of ``numel`` elements is flattened; rank r of N holds elements
``[r * s, (r + 1) * s)`` with ``s = ceil(numel / N)``, the part past ``numel`` zero padding
(invisible to the user). The native runtime's reduce_scatter / allgather use the same rule
(``src/ccl/collective.h``: ShardSize / ValidCount; tests/unit/test_layout.py pins the two
together).
"""
from typing import Tuple

import numpy as np


def shard_size(numel: int, world_size: int) -> int:
    """Elements of one rank's flat padded shard of a tensor of ``numel`` elements."""
    return -(-int(numel) // int(world_size))


def slice_range(numel: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``[begin, end)`` of the real elements rank ``rank`` holds of a flat tensor of
    ``numel`` elements (``end - begin`` < the shard size on the ranks holding padding)."""
    shard = shard_size(numel, world_size)
    begin = min(int(numel), int(rank) * shard)
    return begin, min(int(numel), begin + shard)


def local_shard(array: np.ndarray, world_size: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s flat padded shard of ``array`` (a new array, zero padded)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    begin, end = slice_range(flat.size, world_size, rank)
    out = np.zeros(shard_size(flat.size, world_size), dtype=flat.dtype)
    out[:end - begin] = flat[begin:end]
    return out
