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
