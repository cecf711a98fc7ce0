"""What a checkpoint saves and loads: a train state (parameters, optimizer state, buffers,
frozen parameters, step and seed) held under a layout (``TrainState``: the writers, this
rank's file, the ZeRO level the tensors are sharded at), not a Trainer. Each executor
describes its own state with one (``TrainState.of``); a layout whose ranks hold pieces of
the model (tensor, pipeline parallelism) saves the full tensors as a data-parallel world of
every rank without ZeRO would, so any layout reloads any other's checkpoint."""
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from .._version import __version__
from ..distributed.communicator import raised_on_every_rank
from ..layout.sharding import shard_size, slice_range
from ..layout.state import state_shape
from . import files  # finalize, write_rank_file, read_range: through the module (tests patch them)
from .files import (FORMAT, CheckpointError, OpenFiles, buffer_description, buffer_key,
                    check_compatible, file_digest, files_for, frozen_description, host_array,
                    model_description, param_key, read_meta, resolve, state_key,
                    temporary_name, verify_files)


@dataclasses.dataclass(frozen=True)
class TrainState:
    """A train state's description for a checkpoint.

    ``comm``: the world communicator (agreements, barriers); ``world``: the ranks that write
    one file each (1: this rank alone); ``rank``: this rank's file; ``zero_level``: 3 when
    the parameters given are flat padded shards, > 0 when the optimizer states are;
    ``signature``: names and specs (a training.step.TrainStepSignature); ``frozen``: the
    frozen parameters' values (signature order; empty when loading)."""

    comm: Any
    world: int
    rank: int
    zero_level: int
    signature: Any
    step_count: int
    seed: int
    config: Dict[str, Any]
    loss: str
    optimizer: Any
    tied_params: Dict[str, str]
    non_persistent_buffers: FrozenSet[str]
    frozen: Sequence[Any] = ()
    #: the loop's host state (JSON): skipped steps, the loss scale; the executor's loop_state()
    loop: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, comm: Any, world: int, zero_level: int, signature: Any, step_count: int,
           seed: int, config: Dict[str, Any], loss: str, optimizer: Any, model: Any,
           frozen: Sequence[Any] = (), shared: bool = True,
           loop: Optional[Dict[str, Any]] = None) -> "TrainState":
        """The state of an executor whose ``world`` ranks write a checkpoint together.
        ``shared=False``: a Trainer of ranks that train independently in a world of several
        ranks, which checkpoint nothing together: refused, naming the fix (every rank would
        write the same files)."""
        if not shared and comm.size > 1:
            raise ValueError(
                "save_checkpoint/load_checkpoint on a Trainer without data parallelism in a "
                f"{comm.size}-rank job: every rank would write the same files. Enable "
                "data parallelism, or build the Trainer with Trainer(..., local=True) (a "
                "Trainer of its rank alone, whose checkpoint directory is its own)")
        return cls(comm=comm, world=int(world), rank=comm.rank if world > 1 else 0,
                   zero_level=int(zero_level), signature=signature, step_count=int(step_count),
                   seed=int(seed), config=config, loss=loss, optimizer=optimizer,
                   tied_params=dict(getattr(model, "tied_params", {})),
                   non_persistent_buffers=frozenset(getattr(model, "non_persistent_buffers",
                                                            ())),
                   frozen=tuple(frozen), loop=dict(loop or {}))


def _my_slice(tensor: Any, numel: int, world_size: int, rank: int,
              sharded: bool) -> np.ndarray:
    """Elements [r*s, (r+1)*s) of the flattened tensor, clipped to its true size, from the
    full tensor or (``sharded``) from this rank's padded shard of it."""
    begin, end = slice_range(numel, world_size, rank)
    values = host_array(tensor).reshape(-1)
    return values[:end - begin] if sharded else values[begin:end]


def save(train_state: TrainState, path: Any, params: Sequence[Any], states: Dict[Any, Any],
         extra: Any = None, keep: int = 2, buffers: Optional[Dict[str, Any]] = None) -> Path:
    """An executor's save_checkpoint under ``train_state`` (a TrainState): ``params`` (the
    trainer's runtime tensors, in signature order: full, or shards at level 3) and ``states``
    ({(param, state): full array, or shard under ZeRO}) as this rank's file, then rank 0
    finalizes once every file is on disk.

    A write that fails on any rank (a full disk, a quota) or a failed finalize raises the same
    CheckpointError on every rank, after the ranks agree on it: the job may go on (free space,
    save again). Anything else that leaves the save on one rank ends the job
    (Communicator.collective_work)."""
    rank, world = train_state.rank, train_state.world
    json_extra = json.loads(json.dumps(extra))  # fail now, not after writing shards
    root = Path(path)
    if root.exists() and not root.is_dir():  # every rank sees it: raised before any message
        raise NotADirectoryError(
            f"save_checkpoint({str(path)!r}): {path} is a file, and a checkpoint needs a "
            "directory there (it holds step-NNNNNNNN directories and a 'latest' file); give "
            "a new or existing directory path")
    name = f"step-{train_state.step_count:08d}"
    tmp_name: Any = temporary_name(name) if rank == 0 else None
    tmp = root / (train_state.comm.agree(tmp_name, "agreeing on the checkpoint's temporary "
                                         "directory")[0] if world > 1 else tmp_name)
    with train_state.comm.collective_work(
            f"saving checkpoint {root / name} (last completed: {train_state.step_count})",
            world > 1):
        final = _write(train_state, root, name, tmp, path, params, states, json_extra, keep,
                       buffers)
    return final


def _write(train_state: TrainState, root: Path, name: str, tmp: Path, path: Any,
           params: Sequence[Any], states: Dict[Any, Any], json_extra: Any, keep: int,
           buffers: Optional[Dict[str, Any]]) -> Path:
    """save's collective part: every rank's file, then rank 0's finalize."""
    rank, world = train_state.rank, train_state.world
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    if world > 1:
        train_state.comm.idle_barrier(f"the barrier before writing checkpoint files into {tmp}")
    signature = train_state.signature
    numels = {n: int(np.prod(shape, dtype=np.int64))
              for n, (shape, _) in zip(signature.param_names, signature.param_specs)}
    tensors = {}
    for param, value in zip(signature.param_names, params):
        tensors[param_key(param)] = _my_slice(value, numels[param], world, rank,
                                              train_state.zero_level == 3)
    specs = dict(zip(signature.param_names, signature.param_specs))
    for (param, state), value in states.items():
        numel = int(np.prod(state_shape(specs[param][0], state, signature.row_states),
                            dtype=np.int64))
        tensors[state_key(param, state)] = _my_slice(value, numel, world, rank,
                                                     train_state.zero_level > 0)
    buffers = buffers or {}
    described = buffer_description(signature, buffers,
                                   set(train_state.non_persistent_buffers))
    for record in described:  # replicated: each rank writes its slice, like a parameter
        value = np.asarray(buffers[record["name"]])
        tensors[buffer_key(record["name"])] = _my_slice(value, value.size, world, rank, False)
    for name, value in zip(signature.frozen_names, train_state.frozen):
        # frozen parameters: replicated and constant, stored like a parameter (consolidate)
        tensors[param_key(name)] = _my_slice(value, int(np.prod(value.shape)), world, rank, False)
    file = tmp / f"rank{rank:05d}.safetensors"
    try:  # a full disk, a quota, a lost mount: every rank hears of it and raises alike
        files.write_rank_file(file, tensors)
        record, error = {"name": file.name, "bytes": file.stat().st_size,
                         "sha256": file_digest(file)}, None
    except OSError as exc:
        record, error = None, f"rank {rank} could not write {file}: {exc}"
    outcome = (train_state.comm.agree((record, error), f"the exchange of written files in {tmp}")
               if world > 1 else [(record, error)])
    errors = [e for _, e in outcome if e is not None]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise raised_on_every_rank(CheckpointError(
            f"save_checkpoint({str(path)!r}) failed, nothing was saved and the previous "
            f"checkpoints are intact: {errors[0]}" + (f" (and {len(errors) - 1} more rank(s))"
                                                     if len(errors) > 1 else "")
            + ". Free space (or fix the storage) and save again"))
    records = [r for r, _ in outcome]
    if rank == 0:
        meta = {
            "format": FORMAT, "raf_dist": __version__, "step": train_state.step_count,
            "seed": train_state.seed, "world_size": world, "zero_opt_level": train_state.zero_level,
            "config": train_state.config, "loss": train_state.loss,
            "model": model_description(signature), "buffers": described,
            "frozen": frozen_description(signature),
            # {other name: parameter name} of tied parameters: state_dict() lists every name
            "tied_params": dict(train_state.tied_params),
            "optimizer": {"class": type(train_state.optimizer).__name__,
                          "config": train_state.optimizer.config(),
                          "state_names": list(signature.state_names),
                          "row_states": list(signature.row_states)},
            "loop": json.loads(json.dumps(train_state.loop)),
            "extra": json_extra, "files": records}
        try:
            final, error = files.finalize(root, name, tmp, meta, keep), None
        except OSError as exc:
            final, error = None, f"rank 0 could not finalize {root / name}: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        final, error = None, None
    if world > 1:
        final, error = train_state.comm.agree(
            (final, error), f"the agreement after rank 0 finalized checkpoint {root / name}")[0]
    if error is not None:
        raise raised_on_every_rank(CheckpointError(
            f"save_checkpoint({str(path)!r}) failed: {error}; 'latest' still names a complete "
            "checkpoint. Fix the storage and save again"))
    return final


def _check_frozen(meta: Dict[str, Any], signature: Any) -> None:
    saved = {f["name"]: f for f in meta.get("frozen", [])}
    for name, (shape, dtype) in zip(signature.frozen_names, signature.frozen_specs):
        if name in saved and (saved[name]["shape"] != [int(d) for d in shape]
                              or saved[name]["dtype"] != str(dtype)):
            raise CheckpointError(f"the checkpoint is from a different model: frozen parameter "
                                  f"{name} is {saved[name]['shape']} {saved[name]['dtype']} "
                                  f"there, {list(shape)} {dtype} here")


def _reads(train_state: TrainState, meta: Dict[str, Any]) -> List[Tuple[Any, ...]]:
    """What this rank reads: (kind, name, key, shape, dtype, begin, end, shard_numel) per
    tensor; shard_numel is None for a full tensor, else its padded shard's size."""

    rank, world, signature = train_state.rank, train_state.world, train_state.signature
    reads = []

    def add(kind: str, name: Any, key: str, shape: Sequence[int], dtype: str,
            sharded: bool) -> None:
        numel = int(np.prod(shape, dtype=np.int64))
        begin, end = slice_range(numel, world, rank) if sharded else (0, numel)
        reads.append((kind, name, key, tuple(shape), np.dtype(dtype), begin, end,
                      shard_size(numel, world) if sharded else None))

    specs = dict(zip(signature.param_names, signature.param_specs))
    for p in signature.param_names:
        shape, dtype = specs[p]
        add("param", p, param_key(p), shape, dtype, train_state.zero_level == 3)
    for p, state in signature.state_keys():
        shape, dtype = specs[p]
        add("state", (p, state), state_key(p, state),
            state_shape(shape, state, signature.row_states), dtype, train_state.zero_level > 0)
    for name, (shape, dtype) in zip(signature.buffer_names, signature.buffer_specs):
        add("buffer", name, buffer_key(name), shape, dtype, False)
    saved_frozen = {f["name"] for f in meta.get("frozen", [])}
    for name, (shape, dtype) in zip(signature.frozen_names, signature.frozen_specs):
        if name in saved_frozen:  # an older checkpoint without them: the trainer keeps its own
            add("frozen", name, param_key(name), shape, dtype, False)
    return reads


def load(train_state: TrainState, path: Any) -> Tuple[Any, ...]:
    """An executor's load_checkpoint reading under ``train_state`` (a TrainState): checks on every
    rank first (the same CheckpointError everywhere), then (params, states, buffers, frozen,
    meta) as numpy arrays for the trainer's world size: the parameters in signature order (full,
    or this rank's padded shard at level 3), {(param, state): array} (full, or this rank's
    padded shard under ZeRO), {name: full array} of the carried buffers and of the frozen
    parameters the checkpoint holds.

    Each rank checks the size of every file but the sha256 of only the files it reads, opens
    each of those once, and the ranks agree on the outcome (one allgather) before any data is
    read."""
    with train_state.comm.collective_work(f"loading checkpoint {path}", train_state.world > 1):
        return _read(train_state, path)


def _read(train_state: TrainState, path: Any) -> Tuple[Any, ...]:
    """load's collective part."""
    world = train_state.world
    error, directory, meta = None, None, None
    try:
        directory = resolve(path)
        meta = read_meta(directory)
        check_compatible(meta, train_state.signature, train_state.optimizer)
        _check_frozen(meta, train_state.signature)
        reads = _reads(train_state, meta)
        numels = [int(np.prod(shape, dtype=np.int64)) for _, _, _, shape, *_ in reads]
        needed = set()
        for numel, (_, _, _, _, _, begin, end, _) in zip(numels, reads):
            needed |= files_for(meta, numel, begin, end)
        verify_files(directory, meta, needed)
    except CheckpointError as exc:
        error = str(exc)
    errors = (train_state.comm.agree(error, f"the agreement on checkpoint {path} before reading")
              if world > 1 else [error])
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, e = failed[0]
        raise raised_on_every_rank(CheckpointError(e if world == 1 else f"rank {r}: {e}"))
    out: Dict[str, Dict[Any, Any]] = {"param": {}, "state": {}, "buffer": {}, "frozen": {}}
    with OpenFiles(directory, meta) as opened:
        for numel, (kind, name, key, shape, dtype, begin, end, shard) in zip(numels, reads):
            values = files.read_range(directory, meta, key, numel, begin, end, dtype, opened)
            if shard is None:
                out[kind][name] = values.reshape(shape)
            else:  # this rank's padded shard
                out[kind][name] = np.zeros(shard, dtype=dtype)
                out[kind][name][:end - begin] = values
    params = [out["param"][p] for p in train_state.signature.param_names]
    return params, out["state"], out["buffer"], out["frozen"], meta
