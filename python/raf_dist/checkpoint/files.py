"""The checkpoint format's files: keys, one safetensors file per rank, atomic directories
(``finalize``), verification and range reads across any number of files (the resharding
reads). No Trainer, no train state: ``train_state.py`` decides what is written."""
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path

import numpy as np

from ..layout.sharding import slice_range

FORMAT = "raf_dist-checkpoint-1"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this Trainer (the message says why)."""


def host_array(tensor):
    """A numpy array of a runtime tensor (or the array itself)."""
    return tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)


def file_digest(path):
    """The sha256 of the file at ``path``, as meta.json records it (hex)."""
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


def buffer_description(signature, buffers, non_persistent):
    """The buffers a checkpoint holds: every buffer the step carries (running statistics) and
    every persistent constant one (for consolidate: PyTorch's state_dict has them)."""
    carried = set(signature.buffer_names)
    return [{"name": n, "shape": [int(d) for d in np.shape(v)], "dtype": str(np.asarray(v).dtype),
             "persistent": n not in non_persistent, "carried": n in carried}
            for n, v in buffers.items() if n in carried or n not in non_persistent]


def frozen_description(signature):
    """The frozen (requires_grad=False) parameters a checkpoint holds, full and constant."""
    return [{"name": n, "shape": [int(d) for d in shape], "dtype": str(dtype)}
            for n, (shape, dtype) in zip(signature.frozen_names, signature.frozen_specs)]


def buffer_key(name):
    """The key of buffer ``name``'s slice in a rank file."""
    return f"buffer/{name}"


def state_key(param, state):
    """The key of optimizer state ``state`` of ``param``'s slice in a rank file."""
    return f"state/{param}/{state}"


def param_key(param):
    """The key of parameter ``param``'s slice in a rank file."""
    return f"param/{param}"


# ---- save -------------------------------------------------------------------------------
def write_rank_file(path, tensors):
    """This rank's slices as one safetensors file, flushed to disk."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


STALE_TMP_SECONDS = 24 * 3600  # a temporary this old is no save in progress, whoever made it
_TMP_NAME = re.compile(r"^\.tmp-step-\d+\.([A-Za-z0-9_-]+)\.(\d+)\.[0-9a-f]+$")
_STEP_NAME = re.compile(r"^step-(\d+)(?:\.[0-9a-f]+)?$")


def host_tag():
    """This host's name as it can appear in a directory name."""
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname()) or "host"


def temporary_name(name):
    """``.tmp-<name>.<host>.<pid>.<random>``: whose save it is (rank 0's host and process),
    so that a later save under the same root can tell a killed save from one in progress."""
    return f".tmp-{name}.{host_tag()}.{os.getpid()}.{secrets.token_hex(4)}"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _is_stale(tmp):
    """The sweep rule: a temporary directory may be deleted when this process made it (its
    save was interrupted and this process goes on), when it names a process on this host that
    is no longer alive, or when it is older than STALE_TMP_SECONDS. Anything else (another
    host's, a live process's) may be another job's save in progress under the same root."""
    try:
        age = time.time() - tmp.stat().st_mtime
    except FileNotFoundError:
        return False
    if age > STALE_TMP_SECONDS:
        return True
    match = _TMP_NAME.match(tmp.name)
    if match is None or match.group(1) != host_tag():
        return False
    pid = int(match.group(2))
    return pid == os.getpid() or not _pid_alive(pid)


def step_of(directory_name):
    """The step number of a checkpoint directory's name (``step-00000120`` or, for a step
    saved again, ``step-00000120.<random>``), or None for any other name."""
    match = _STEP_NAME.match(directory_name)
    return int(match.group(1)) if match else None


def _write_latest(root, name):
    latest_tmp = root / f".{LATEST}.tmp.{os.getpid()}"
    latest_tmp.write_text(name + "\n")
    with open(latest_tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)


def finalize(root, name, tmp, meta, keep):
    """Rank 0, once every rank's file is on disk: meta.json, rename into place, point
    ``latest`` at it, drop checkpoints beyond the newest ``keep`` steps and stale temporaries.
    Returns the checkpoint's directory.

    Every moment leaves ``latest`` naming a complete checkpoint: a step saved again goes to a
    new name (``step-N.<random>``), ``latest`` moves to it, and only then is the old copy of
    the step deleted."""
    meta_path = tmp / "meta.json"
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = root / name
    if final.exists():  # the same step saved again: the old copy stays until latest moves
        final = root / f"{name}.{secrets.token_hex(4)}"
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_latest(root, final.name)
    step = step_of(final.name)
    complete = [(step_of(p.name), p) for p in root.glob("step-*")
                if step_of(p.name) is not None and (p / "meta.json").exists()]
    kept = sorted({s for s, _ in complete})[-keep:] if keep > 0 else None
    for old_step, old in complete:
        # never what latest names; other copies of this step are the ones it replaced
        if old != final and (old_step == step or (kept is not None and old_step not in kept)):
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):  # left by saves that were killed
        if stale != tmp and _is_stale(stale):
            shutil.rmtree(stale, ignore_errors=True)
    return final


# ---- load -------------------------------------------------------------------------------
def resolve(path):
    """The checkpoint directory ``path`` names: ``path/<latest>`` or ``path`` itself."""
    root = Path(path)
    if (root / LATEST).is_file():
        name = (root / LATEST).read_text().strip()
        if not name.startswith("step-") or "/" in name:
            raise CheckpointError(
                f"{root / LATEST} is corrupted (names {name!r}): it must name a "
                f"step-NNNNNNNN directory beside it, as save_checkpoint writes it; load a step "
                f"directory directly with load_checkpoint('{root}/step-NNNNNNNN')")
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


def verify_files(directory, meta, read=None):
    """Every rank's file is present with the recorded size (cheap), and the files this process
    reads (``read``: their ranks; None = all) have the recorded sha256."""
    for r, record in enumerate(meta["files"]):
        path = directory / record["name"]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (the checkpoint was written by "
                                  f"{meta['world_size']} ranks, one file each)")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointError(f"{path} is truncated or altered: {size} bytes, "
                                  f"{record['bytes']} recorded")
    for r in sorted(range(len(meta["files"])) if read is None else read):
        record = meta["files"][r]
        if file_digest(directory / record["name"]) != record["sha256"]:
            raise CheckpointError(f"{directory / record['name']} is corrupted: its sha256 "
                                  "differs from the one recorded at save time")


def files_for(meta, numel, begin, end):
    """The saved ranks whose slices of a ``numel``-element tensor overlap [begin, end)."""
    world = meta["world_size"]
    return {r for r in range(world)
            if max(slice_range(numel, world, r)[0], begin)
            < min(slice_range(numel, world, r)[1], end)}


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
    saved = {b["name"]: b for b in meta.get("buffers", [])}
    for name, (shape, dtype) in zip(signature.buffer_names, signature.buffer_specs):
        if name not in saved:
            raise CheckpointError(f"the checkpoint has no buffer {name} (running statistics "
                                  "this model carries); it was saved from another model or by "
                                  "a raf_dist without buffer support")
        if saved[name]["shape"] != [int(d) for d in shape] or saved[name]["dtype"] != str(dtype):
            raise CheckpointError(f"the checkpoint is from a different model: buffer {name} is "
                                  f"{saved[name]['shape']} {saved[name]['dtype']} there, "
                                  f"{list(shape)} {dtype} here")
    if meta["optimizer"]["state_names"] != list(signature.state_names):
        raise CheckpointError(
            f"the checkpoint's optimizer ({meta['optimizer']['class']}) keeps state "
            f"{meta['optimizer']['state_names']}; {type(optimizer).__name__} here keeps "
            f"{list(signature.state_names)}")
    if meta["optimizer"].get("row_states", []) != list(signature.row_states):
        raise CheckpointError(
            f"the checkpoint's optimizer ({meta['optimizer']['class']}) keeps "
            f"{meta['optimizer'].get('row_states', []) or 'no'} state one value per row; "
            f"{type(optimizer).__name__} here keeps {list(signature.row_states) or 'none'} "
            "so: resume with the optimizer that saved it")
    saved_groups = [g["params"] for g in meta["optimizer"]["config"].get("param_groups", [])]
    groups = [list(g["params"]) for g in getattr(optimizer, "param_groups", [])]
    if saved_groups != groups:  # which parameters share hyper-parameters; values may change
        raise CheckpointError(
            f"the checkpoint was trained with optimizer param_groups {saved_groups} (patterns "
            f"per group); this optimizer has {groups}. Build the optimizer with the same "
            "groups (their lr / weight_decay may differ)")


class OpenFiles:
    """The rank files of one checkpoint, each opened once (safetensors ``safe_open``, which
    reads only the bytes a slice needs) and kept open until ``close`` (or the end of a
    ``with`` block): a load reads many tensors from each file."""

    def __init__(self, directory, meta):
        self.directory, self.meta = Path(directory), meta
        self._handles, self._stack = {}, contextlib.ExitStack()

    def __getitem__(self, rank):
        if rank not in self._handles:
            from safetensors import safe_open

            path = self.directory / self.meta["files"][rank]["name"]
            self._handles[rank] = self._stack.enter_context(safe_open(str(path), framework="numpy"))
        return self._handles[rank]

    def close(self):
        self._handles.clear()
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def read_range(directory, meta, key, numel, begin, end, dtype, files=None):
    """Elements [begin, end) of the flattened tensor ``key``, from the ranks' slices that
    overlap it (only the needed bytes are read). ``files``: an OpenFiles of this checkpoint
    to read through (else each file is opened for this one tensor)."""
    if files is None:
        with OpenFiles(directory, meta) as opened:
            return read_range(directory, meta, key, numel, begin, end, dtype, opened)
    out = np.empty(end - begin, dtype=dtype)
    world = meta["world_size"]
    for r in range(world):
        b, e = slice_range(numel, world, r)
        lo, hi = max(b, begin), min(e, end)
        if lo >= hi:
            continue
        out[lo - begin:hi - begin] = files[r].get_slice(key)[lo - b:hi - b]
    return out
