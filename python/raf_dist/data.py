"""Feeding data-parallel ranks: each rank takes its slice of every global batch.
(Under tensor parallelism "rank" and "N" below are the rank's data-parallel index and the
data-parallel size of the mesh: ranks that differ only in tp get the same rows.)

``shard(loader)`` (DESIGN.md section 1) takes any iterable of global batches — tuples of
arrays or tensors with the batch on dim 0, e.g. a torch DataLoader — and yields this rank's
rows of each as numpy arrays: rank r gets rows [r*b, (r+1)*b), b = batch / N. A batch whose
size differs from the first one (a DataLoader's short last batch) is skipped by default
(``drop_last=True``); with ``drop_last=False`` it is split as evenly as it goes, the first
ranks taking one row more (7 rows on 2 ranks: 4 + 3), and ``Trainer.step`` weights the ranks'
losses so the step is that of one process on the whole batch.

``shard(arrays, global_batch)`` yields, for each global batch (consecutive rows of every array),
this rank's rows: rank r gets rows [r*b, (r+1)*b) of the batch, b = global_batch / N. All ranks
see the same number of steps.

The uneven tail (fewer than ``global_batch`` rows left at the end of an epoch) is dropped by
default (``drop_last=True``), as torch's DataLoader(drop_last=True) does. With
``drop_last=False`` it is one last, smaller global batch, split as evenly as it goes (the
first ranks take one row more; no row is repeated): ``Trainer.step`` accepts any batch size
and weights each rank's loss by its rows, so the loss and update are those of one process on
that batch. A tail with fewer rows than ranks cannot give every rank a row and raises. With
``drop_last=False, pad_last=True`` the tail is instead filled with rows from the start of the
data, as ``torch.utils.data.DistributedSampler`` pads (every step the same shape; the padded
rows count twice).
Shuffle with ``seed``: every rank draws the same permutation, so the slices never overlap.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Union

import numpy as np

from .distributed import get_communicator

#: what ``shard`` yields per step: one array, or a tuple with one array per input
Batch = Union[np.ndarray, tuple[np.ndarray, ...]]


def shard(arrays: Iterable[Any], global_batch: int | None = None, shuffle: bool = False,
          seed: int = 0, epoch: int = 0, drop_last: bool = True, rank: int | None = None,
          world_size: int | None = None, pad_last: bool = False) -> Iterator[Batch]:
    """Yield this rank's slice of each global batch: a tuple with one array per input array
    (or a single array if ``arrays`` is one array). Without ``global_batch``, ``arrays`` is a
    loader of global batches (see the module docstring). ``drop_last=False``: the short last
    batch is split unevenly over the ranks, or, with ``pad_last=True`` (arrays only), padded
    from the start of the data."""
    if rank is None or world_size is None:
        rank, world_size = _data_parallel_position()
    if global_batch is None:
        return _shard_loader(arrays, rank, world_size, drop_last)
    return _shard_arrays(arrays, global_batch, shuffle, seed, epoch, drop_last, rank, world_size,
                         pad_last)


def _data_parallel_position() -> tuple[int, int]:
    """(index, size) of this rank on the data-parallel axis: the world without a mesh; with
    tensor (or pipeline) parallelism the mesh's dp axis, so that ranks differing only in tp
    get the same rows (DESIGN.md section 1; dist.get_mesh(), collective on first use)."""
    from .distributed import get_config
    from .distributed.mesh import get_mesh

    config = get_config()
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        mesh = get_mesh(config)
        return mesh.dp_rank, mesh.dp_size
    comm = get_communicator()
    return comm.rank, comm.size


def uneven_rows(num_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[begin, end) of ``rank``'s rows when ``num_rows`` rows are split over ``world_size``
    ranks as evenly as they go, the first ranks taking one more (np.array_split's rule)."""
    if num_rows < world_size:
        raise ValueError(f"the last global batch has {num_rows} rows, fewer than the "
                         f"{world_size} ranks: some rank would get no row. Use drop_last=True "
                         "(drop it), pad_last=True (pad it from the start of the data), or a "
                         "dataset whose tail has at least one row per rank")
    base, extra = divmod(num_rows, world_size)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (1 if rank < extra else 0)


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def _shard_loader(loader: Iterable[Any], rank: int, world_size: int,
                  drop_last: bool = True) -> Iterator[Batch]:
    first_size = None
    for batch in loader:
        single = not isinstance(batch, (tuple, list))
        parts = [_numpy(b) for b in ((batch,) if single else batch)]
        size = len(parts[0])
        if first_size is None:
            if size % world_size:
                raise ValueError(f"global batch of {size} rows does not divide by {world_size} "
                                 f"ranks; use a batch size that is a multiple of {world_size}")
            first_size = size
        if size != first_size:  # a short last batch: dropped, or split unevenly
            if drop_last:
                continue
            begin, end = uneven_rows(size, world_size, rank)
            out = tuple(p[begin:end] for p in parts)
            yield out[0] if single else out
            continue
        local = size // world_size
        out = tuple(p[rank * local:(rank + 1) * local] for p in parts)
        yield out[0] if single else out


def _shard_arrays(arrays: Iterable[Any], global_batch: int, shuffle: bool, seed: int, epoch: int,
                  drop_last: bool, rank: int, world_size: int,
                  pad_last: bool = False) -> Iterator[Batch]:
    single = isinstance(arrays, np.ndarray)
    arrays = (arrays,) if single else tuple(np.asarray(a) for a in arrays)
    num = len(arrays[0])
    if any(len(a) != num for a in arrays):
        raise ValueError(f"arrays have different lengths: {[len(a) for a in arrays]}")
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must divide by the number of ranks "
                         f"({world_size}); use a multiple of {world_size}")
    if num < global_batch:
        raise ValueError(f"{num} samples are fewer than one global batch of {global_batch}")
    order = np.arange(num)
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(num)  # (1, 0) != (0, 1)
    steps = num // global_batch
    tail = 0 if drop_last else num % global_batch
    if tail and pad_last:  # DistributedSampler's padding: every step the same shape
        steps += 1
        order = np.concatenate([order, order[: steps * global_batch - num]])
        tail = 0
    elif tail:
        uneven_rows(tail, world_size, rank)  # no rank without rows: raised before any step
    local = global_batch // world_size
    for step in range(steps):
        rows = order[step * global_batch + rank * local: step * global_batch + (rank + 1) * local]
        batch = tuple(a[rows] for a in arrays)
        yield batch[0] if single else batch
    if tail:  # the short last global batch, split unevenly (no row repeated)
        begin, end = uneven_rows(tail, world_size, rank)
        rows = order[steps * global_batch + begin: steps * global_batch + end]
        batch = tuple(a[rows] for a in arrays)
        yield batch[0] if single else batch


def num_steps(num_samples: int, global_batch: int, drop_last: bool = True) -> int:
    """Steps per epoch that ``shard`` yields."""
    return num_samples // global_batch + (0 if drop_last or num_samples % global_batch == 0 else 1)
