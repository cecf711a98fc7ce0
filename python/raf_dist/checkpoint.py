"""Sharded, reshardable, atomic checkpoints (safetensors; nothing is ever unpickled).

Layout of ``save_checkpoint(root)``::

    root/latest                     name of the newest complete checkpoint ("step-00000120")
    root/step-00000120/meta.json    format, model and optimizer description, step, seed,
                                    config, world size, ZeRO level, the caller's ``extra``
                                    (data position), and size + sha256 of every rank's file
    root/step-00000120/rank00000.safetensors ... one file per rank

Every tensor (each parameter and each optimizer state) is stored as N flat slices: rank r
writes elements [r*s, (r+1)*s) of the flattened tensor, s = ceil(numel / N), clipped to the
true size (DESIGN.md section 3's shards without their padding). That is what a ZeRO rank
holds anyway, and at levels 0-2 it keeps each rank's file at 1/N of the model, so any world
size and level can read any checkpoint: a rank loads exactly the element ranges it needs.

Atomicity: files are written into ``root/.tmp-step-...``, flushed to disk, and only when
every rank is done does rank 0 write meta.json, rename the directory into place and then
replace ``latest`` (os.replace). A save killed at any moment leaves ``latest`` naming the
previous complete checkpoint. Loading checks every file's size and sha256 before reading.

``save`` and ``load`` at the end are Trainer.save_checkpoint / load_checkpoint: which element
ranges this rank writes and reads for its world size and ZeRO level.
"""
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

FORMAT = "raf_dist-checkpoint-1"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this Trainer (the message says why)."""


def slice_range(numel, world_size, rank):
    """Elements [begin, end) of a flattened tensor that ``rank`` of ``world_size`` stores."""
    shard = -(-int(numel) // int(world_size))
    begin = min(int(numel), rank * shard)
    return begin, min(int(numel), begin + shard)


def host_array(tensor):
    """A numpy array of a runtime tensor (or the array itself)."""
    return tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)


def _file_digest(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_description(signature):
    """What must match for a checkpoint to fit a model: names, shapes and dtypes."""
    return [{"name": n, "shape": [int(d) for d in shape], "dtype": str(dtype)}
            for n, (shape, dtype) in zip(signature.param_names, signature.param_specs)]


def _state_key(param, state):
    return f"state/{param}/{state}"


def _param_key(param):
    return f"param/{param}"


# ---- save -------------------------------------------------------------------------------
def write_rank_file(path, tensors):
    """This rank's slices as one safetensors file, flushed to disk."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def finalize(root, name, tmp, meta, keep):
    """Rank 0, once every rank's file is on disk: meta.json, rename into place, point
    ``latest`` at it, drop checkpoints beyond the newest ``keep``."""
    meta_path = tmp / "meta.json"
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / name
    if final.exists():  # the same step saved again: replace it (latest moves off it first)
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(name + "\n")
    with open(latest_tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)
    complete = sorted(p for p in root.glob("step-*") if (p / "meta.json").exists())
    for old in complete[:-keep] if keep > 0 else []:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):  # left by saves that were killed
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)


# ---- load -------------------------------------------------------------------------------
def resolve(path):
    """The checkpoint directory ``path`` names: ``path/<latest>`` or ``path`` itself."""
    root = Path(path)
    if (root / LATEST).is_file():
        name = (root / LATEST).read_text().strip()
        if not name.startswith("step-") or "/" in name:
            raise CheckpointError(f"{root / LATEST} is corrupted (names {name!r})")
        return root / name
    if (root / "meta.json").is_file():
        return root
    raise CheckpointError(f"no checkpoint in {root}: expected {root / LATEST} or "
                          f"{root / 'meta.json'} (written by Trainer.save_checkpoint)")


def read_meta(directory):
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory / 'meta.json'} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{directory / 'meta.json'} is corrupted ({exc})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory} has format {meta.get('format')!r}; this raf_dist "
                              f"reads {FORMAT!r}")
    return meta


def verify_files(directory, meta):
    """Every rank's file is present with the recorded size and sha256."""
    for r, record in enumerate(meta["files"]):
        path = directory / record["name"]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (the checkpoint was written by "
                                  f"{meta['world_size']} ranks, one file each)")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(f"{path} is truncated or altered: {size} bytes, "
                                  f"{record['bytes']} recorded")
        if _file_digest(path) != record["sha256"]:
            raise CheckpointError(f"{path} is corrupted: its sha256 differs from the one "
                                  "recorded at save time")


def check_compatible(meta, signature, optimizer):
    mine = model_description(signature)
    theirs = meta["model"]
    if [p["name"] for p in theirs] != [p["name"] for p in mine]:
        missing = sorted({p["name"] for p in mine} - {p["name"] for p in theirs})
        extra = sorted({p["name"] for p in theirs} - {p["name"] for p in mine})
        raise CheckpointError(
            "the checkpoint is from a different model: parameters "
            f"{'missing from it ' + str(missing) if missing else ''}"
            f"{' not in this model ' + str(extra) if extra else ''}".rstrip()
            if missing or extra else "the checkpoint lists the parameters in another order")
    for a, b in zip(mine, theirs):
        if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
            raise CheckpointError(f"the checkpoint is from a different model: {a['name']} is "
                                  f"{b['shape']} {b['dtype']} there, {a['shape']} {a['dtype']} "
                                  "here")
    if meta["optimizer"]["state_names"] != list(signature.state_names):
        raise CheckpointError(
            f"the checkpoint's optimizer ({meta['optimizer']['class']}) keeps state "
            f"{meta['optimizer']['state_names']}; {type(optimizer).__name__} here keeps "
            f"{list(signature.state_names)}")


def read_range(directory, meta, key, numel, begin, end, dtype):
    """Elements [begin, end) of the flattened tensor ``key``, from the ranks' slices that
    overlap it (each file opened lazily; only the needed bytes are read)."""
    from safetensors import safe_open

    out = np.empty(end - begin, dtype=dtype)
    world = meta["world_size"]
    for r in range(world):
        b, e = slice_range(numel, world, r)
        lo, hi = max(b, begin), min(e, end)
        if lo >= hi:
            continue
        with safe_open(str(directory / meta["files"][r]["name"]), framework="numpy") as f:
            out[lo - begin:hi - begin] = f.get_slice(key)[lo - b:hi - b]
    return out


# ---- a Trainer's checkpoints ------------------------------------------------------------
def _rank(trainer):
    """The rank whose file this process writes and whose ranges it reads."""
    if not trainer.data_parallel and trainer.comm.size > 1:
        raise ValueError(
            "save_checkpoint/load_checkpoint on a Trainer without data parallelism in a "
            f"{trainer.comm.size}-rank job: every rank would use the same files. Enable "
            "data parallelism, or give each rank its own directory")
    return trainer.comm.rank if trainer.world > 1 else 0


def _my_slice(tensor, numel, world_size, rank, sharded):
    """Elements [r*s, (r+1)*s) of the flattened tensor, clipped to its true size, from the
    full tensor or (``sharded``) from this rank's padded shard of it."""
    begin, end = slice_range(numel, world_size, rank)
    values = host_array(tensor).reshape(-1)
    return values[:end - begin] if sharded else values[begin:end]


def save(trainer, path, params, states, extra=None, keep=2):
    """Trainer.save_checkpoint: ``params`` (the trainer's runtime tensors, in signature
    order: full, or shards at level 3) and ``states`` ({(param, state): full array, or shard
    under ZeRO}) as this rank's file, then rank 0 finalizes once every file is on disk."""
    from . import __version__

    rank, world = _rank(trainer), trainer.world
    json_extra = json.loads(json.dumps(extra))  # fail now, not after writing shards
    root = Path(path)
    name = f"step-{trainer.step_count:08d}"
    tmp = root / f".tmp-{name}"
    trainer.comm.activity = f"saving checkpoint {root / name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if world > 1:
        trainer.comm.idle_barrier()
    signature = trainer.signature
    numels = {n: int(np.prod(shape, dtype=np.int64))
              for n, (shape, _) in zip(signature.param_names, signature.param_specs)}
    tensors = {}
    for param, value in zip(signature.param_names, params):
        tensors[_param_key(param)] = _my_slice(value, numels[param], world, rank,
                                               trainer.zero_level == 3)
    for (param, state), value in states.items():
        tensors[_state_key(param, state)] = _my_slice(value, numels[param], world, rank,
                                                      trainer.zero_level > 0)
    file = tmp / f"rank{rank:05d}.safetensors"
    write_rank_file(file, tensors)
    record = {"name": file.name, "bytes": file.stat().st_size, "sha256": _file_digest(file)}
    records = trainer.comm.mpi_comm.gather(record, root=0) if world > 1 else [record]
    if rank == 0:
        meta = {
            "format": FORMAT, "raf_dist": __version__, "step": trainer.step_count,
            "seed": trainer.seed, "world_size": world, "zero_opt_level": trainer.zero_level,
            "config": trainer.config, "loss": trainer.loss,
            "model": model_description(signature),
            "optimizer": {"class": type(trainer.optimizer).__name__,
                          "config": trainer.optimizer.config(),
                          "state_names": list(signature.state_names)},
            "extra": json_extra, "files": records}
        finalize(root, name, tmp, meta, keep)
    if world > 1:
        trainer.comm.idle_barrier()
    trainer.comm.activity = None
    return root / name


def load(trainer, path):
    """Trainer.load_checkpoint's reading: checks on every rank first (the same
    CheckpointError everywhere), then (params, states, meta) — the parameters in signature
    order (full, or this rank's padded shard at level 3) and {(param, state): array} (full,
    or this rank's padded shard under ZeRO) as numpy arrays, for the trainer's world size."""
    from .passes import shard_size

    rank, world = _rank(trainer), trainer.world
    trainer.comm.activity = f"loading checkpoint {path}"
    error, directory, meta = None, None, None
    try:
        directory = resolve(path)
        meta = read_meta(directory)
        check_compatible(meta, trainer.signature, trainer.optimizer)
        verify_files(directory, meta)
    except CheckpointError as exc:
        error = str(exc)
    errors = trainer.comm.mpi_comm.allgather(error) if world > 1 else [error]
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        trainer.comm.activity = None
        r, e = failed[0]
        raise CheckpointError(e if world == 1 else f"rank {r}: {e}")
    specs = dict(zip(trainer.signature.param_names, trainer.signature.param_specs))

    def read(key, param, sharded):
        shape, dtype = specs[param]
        numel = int(np.prod(shape, dtype=np.int64))
        if not sharded:
            return read_range(directory, meta, key, numel, 0, numel, dtype).reshape(shape)
        begin, end = slice_range(numel, world, rank)
        shard = np.zeros(shard_size(numel, world), dtype=dtype)
        shard[:end - begin] = read_range(directory, meta, key, numel, begin, end, dtype)
        return shard

    params = [read(_param_key(p), p, trainer.zero_level == 3)
              for p in trainer.signature.param_names]
    states = {(p, s): read(_state_key(p, s), p, trainer.zero_level > 0)
              for p, s in trainer.signature.state_keys()}
    trainer.comm.activity = None
    return params, states, meta
