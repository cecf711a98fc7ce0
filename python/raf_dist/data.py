"""Feeding data-parallel ranks: each rank takes its slice of every global batch.

``shard(loader)`` (DESIGN.md section 1) takes any iterable of global batches — tuples of
arrays or tensors with the batch on dim 0, e.g. a torch DataLoader — and yields this rank's
rows of each as numpy arrays: rank r gets rows [r*b, (r+1)*b), b = batch / N. A batch whose
size differs from the first one (a DataLoader's short last batch) is skipped, because the
compiled step has fixed shapes; use drop_last=True on the loader to avoid it.

``shard(arrays, global_batch)`` yields, for each global batch (consecutive rows of every array),
this rank's rows: rank r gets rows [r*b, (r+1)*b) of the batch, b = global_batch / N. All ranks
see the same number of steps with the same per-rank shape (the compiled step has fixed shapes).

The uneven tail (fewer than ``global_batch`` rows left at the end of an epoch) is dropped by
default (``drop_last=True``), as torch's DataLoader(drop_last=True) does; with
``drop_last=False`` the tail is filled with rows from the start of the data, as
``torch.utils.data.DistributedSampler`` pads, so every sample is seen at least once.
Shuffle with ``seed``: every rank draws the same permutation, so the slices never overlap.
"""
import numpy as np

from .distributed import get_communicator


def shard(arrays, global_batch=None, shuffle=False, seed=0, epoch=0, drop_last=True, rank=None,
          world_size=None):
    """Yield this rank's slice of each global batch: a tuple with one array per input array
    (or a single array if ``arrays`` is one array). Without ``global_batch``, ``arrays`` is a
    loader of global batches (see the module docstring)."""
    if rank is None or world_size is None:
        comm = get_communicator()
        rank, world_size = comm.rank, comm.size
    if global_batch is None:
        return _shard_loader(arrays, rank, world_size)
    return _shard_arrays(arrays, global_batch, shuffle, seed, epoch, drop_last, rank, world_size)


def _numpy(value):
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def _shard_loader(loader, rank, world_size):
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
        if size != first_size:  # a short last batch: the compiled step has fixed shapes
            continue
        local = size // world_size
        out = tuple(p[rank * local:(rank + 1) * local] for p in parts)
        yield out[0] if single else out


def _shard_arrays(arrays, global_batch, shuffle, seed, epoch, drop_last, rank, world_size):
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
    if not drop_last and num % global_batch:
        steps += 1
        order = np.concatenate([order, order[: steps * global_batch - num]])
    local = global_batch // world_size
    for step in range(steps):
        rows = order[step * global_batch + rank * local: step * global_batch + (rank + 1) * local]
        batch = tuple(a[rows] for a in arrays)
        yield batch[0] if single else batch


def num_steps(num_samples, global_batch, drop_last=True):
    """Steps per epoch that ``shard`` yields."""
    return num_samples // global_batch + (0 if drop_last or num_samples % global_batch == 0 else 1)
