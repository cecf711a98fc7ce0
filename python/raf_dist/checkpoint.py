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

Atomicity: files are written into ``root/.tmp-step-N.<host>.<pid>.<random>``, flushed to
disk, and only when every rank is done does rank 0 write meta.json, rename the directory
into place and then replace ``latest`` (os.replace). A save killed at any moment leaves
``latest`` naming a complete checkpoint: a step saved again goes to ``step-N.<random>``
and the old copy is deleted only after ``latest`` moved (``finalize``). Pruning keeps the
newest ``keep`` step numbers and never what ``latest`` names; stale temporaries are swept by
the rule of ``_is_stale``. Loading checks every file's size, and the sha256 of each file the
rank reads, before reading; each file is opened once per load (``OpenFiles``).

``save`` and ``load`` at the end are Trainer.save_checkpoint / load_checkpoint: which element
ranges this rank writes and reads for its world size and ZeRO level.
"""
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

from .distributed.communicator import raised_on_every_rank
from .layout.sharding import shard_size, slice_range  # noqa: F401  (slice_range: part of this module's API)

FORMAT = "raf_dist-checkpoint-1"
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this Trainer (the message says why)."""


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


def _buffer_key(name):
    return f"buffer/{name}"


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


STALE_TMP_SECONDS = 24 * 3600  # a temporary this old is no save in progress, whoever made it
_TMP_NAME = re.compile(r"^\.tmp-step-\d+\.([A-Za-z0-9_-]+)\.(\d+)\.[0-9a-f]+$")
_STEP_NAME = re.compile(r"^step-(\d+)(?:\.[0-9a-f]+)?$")


def _host_tag():
    """This host's name as it can appear in a directory name."""
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname()) or "host"


def temporary_name(name):
    """``.tmp-<name>.<host>.<pid>.<random>``: whose save it is (rank 0's host and process),
    so that a later save under the same root can tell a killed save from one in progress."""
    return f".tmp-{name}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}"


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
    if match is None or match.group(1) != _host_tag():
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
        if _file_digest(directory / record["name"]) != record["sha256"]:
            raise CheckpointError(f"{directory / record['name']} is corrupted: its sha256 "
                                  "differs from the one recorded at save time")


def files_for(meta, numel, begin, end):
    """The saved ranks whose slices of a ``numel``-element tensor overlap [begin, end)."""
    world = meta["world_size"]
    return {r for r in range(world)
            if max(slice_range(numel, world, r)[0], begin) < min(slice_range(numel, world, r)[1], end)}


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


# ---- a Trainer's checkpoints ------------------------------------------------------------
def _rank(trainer):
    """The rank whose file this process writes and whose ranges it reads."""
    if not trainer.data_parallel and trainer.comm.size > 1 and not getattr(trainer, "local",
                                                                            False):
        raise ValueError(
            "save_checkpoint/load_checkpoint on a Trainer without data parallelism in a "
            f"{trainer.comm.size}-rank job: every rank would write the same files. Enable "
            "data parallelism, or build the Trainer with Trainer(..., local=True) (a Trainer "
            "of its rank alone, whose checkpoint directory is its own)")
    return trainer.comm.rank if trainer.world > 1 else 0


def _my_slice(tensor, numel, world_size, rank, sharded):
    """Elements [r*s, (r+1)*s) of the flattened tensor, clipped to its true size, from the
    full tensor or (``sharded``) from this rank's padded shard of it."""
    begin, end = slice_range(numel, world_size, rank)
    values = host_array(tensor).reshape(-1)
    return values[:end - begin] if sharded else values[begin:end]


def save(trainer, path, params, states, extra=None, keep=2, buffers=None):
    """Trainer.save_checkpoint: ``params`` (the trainer's runtime tensors, in signature
    order: full, or shards at level 3) and ``states`` ({(param, state): full array, or shard
    under ZeRO}) as this rank's file, then rank 0 finalizes once every file is on disk.

    A write that fails on any rank (a full disk, a quota) or a failed finalize raises the
    same CheckpointError on every rank, after the ranks agree on it: the job may go on (free
    space, save again). Anything else that leaves the save on one rank ends the job
    (Communicator.collective_work)."""
    rank, world = _rank(trainer), trainer.world
    json_extra = json.loads(json.dumps(extra))  # fail now, not after writing shards
    root = Path(path)
    if root.exists() and not root.is_dir():  # every rank sees it: raised before any message
        raise NotADirectoryError(
            f"save_checkpoint({str(path)!r}): {path} is a file, and a checkpoint needs a "
            "directory there (it holds step-NNNNNNNN directories and a 'latest' file); give "
            "a new or existing directory path")
    name = f"step-{trainer.step_count:08d}"
    tmp_name = temporary_name(name) if rank == 0 else None
    tmp = root / (trainer.comm.agree(tmp_name, "agreeing on the checkpoint's temporary "
                                     "directory")[0] if world > 1 else tmp_name)
    with trainer.comm.collective_work(
            f"saving checkpoint {root / name} (last completed: {trainer.step_count})",
            world > 1):
        final = _write(trainer, root, name, tmp, path, params, states, json_extra, keep,
                       buffers)
    return final


def _write(trainer, root, name, tmp, path, params, states, json_extra, keep, buffers):
    """save's collective part: every rank's file, then rank 0's finalize."""
    from ._version import __version__

    rank, world = _rank(trainer), trainer.world
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    if world > 1:
        trainer.comm.idle_barrier(f"the barrier before writing checkpoint files into {tmp}")
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
    buffers = buffers or {}
    described = buffer_description(signature, buffers,
                                   set(getattr(trainer.model, "non_persistent_buffers", ())))
    for record in described:  # replicated: each rank writes its slice, like a parameter
        value = np.asarray(buffers[record["name"]])
        tensors[_buffer_key(record["name"])] = _my_slice(value, value.size, world, rank, False)
    for name, value in zip(signature.frozen_names, getattr(trainer, "_frozen", ())):
        # frozen parameters: replicated and constant, stored like a parameter (consolidate)
        tensors[_param_key(name)] = _my_slice(value, int(np.prod(value.shape)), world, rank, False)
    file = tmp / f"rank{rank:05d}.safetensors"
    try:  # a full disk, a quota, a lost mount: every rank hears of it and raises alike
        write_rank_file(file, tensors)
        record, error = {"name": file.name, "bytes": file.stat().st_size,
                         "sha256": _file_digest(file)}, None
    except OSError as exc:
        record, error = None, f"rank {rank} could not write {file}: {exc}"
    outcome = (trainer.comm.agree((record, error), f"the exchange of written files in {tmp}")
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
            "format": FORMAT, "raf_dist": __version__, "step": trainer.step_count,
            "seed": trainer.seed, "world_size": world, "zero_opt_level": trainer.zero_level,
            "config": trainer.config, "loss": trainer.loss,
            "model": model_description(signature), "buffers": described,
            "frozen": frozen_description(signature),
            # {other name: parameter name} of tied parameters: state_dict() lists every name
            "tied_params": dict(getattr(trainer.model, "tied_params", {})),
            "optimizer": {"class": type(trainer.optimizer).__name__,
                          "config": trainer.optimizer.config(),
                          "state_names": list(signature.state_names)},
            "extra": json_extra, "files": records}
        try:
            final, error = finalize(root, name, tmp, meta, keep), None
        except OSError as exc:
            final, error = None, f"rank 0 could not finalize {root / name}: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        final, error = None, None
    if world > 1:
        final, error = trainer.comm.agree(
            (final, error), f"the agreement after rank 0 finalized checkpoint {root / name}")[0]
    if error is not None:
        raise raised_on_every_rank(CheckpointError(
            f"save_checkpoint({str(path)!r}) failed: {error}; 'latest' still names a complete "
            "checkpoint. Fix the storage and save again"))
    return final


def _check_frozen(meta, signature):
    saved = {f["name"]: f for f in meta.get("frozen", [])}
    for name, (shape, dtype) in zip(signature.frozen_names, signature.frozen_specs):
        if name in saved and (saved[name]["shape"] != [int(d) for d in shape]
                              or saved[name]["dtype"] != str(dtype)):
            raise CheckpointError(f"the checkpoint is from a different model: frozen parameter "
                                  f"{name} is {saved[name]['shape']} {saved[name]['dtype']} "
                                  f"there, {list(shape)} {dtype} here")


def _reads(trainer, meta):
    """What this rank reads: (kind, name, key, shape, dtype, begin, end, shard_numel) per
    tensor; shard_numel is None for a full tensor, else its padded shard's size."""

    rank, world, signature = _rank(trainer), trainer.world, trainer.signature
    reads = []

    def add(kind, name, key, shape, dtype, sharded):
        numel = int(np.prod(shape, dtype=np.int64))
        begin, end = slice_range(numel, world, rank) if sharded else (0, numel)
        reads.append((kind, name, key, tuple(shape), np.dtype(dtype), begin, end,
                      shard_size(numel, world) if sharded else None))

    specs = dict(zip(signature.param_names, signature.param_specs))
    for p in signature.param_names:
        add("param", p, _param_key(p), *specs[p], trainer.zero_level == 3)
    for p, state in signature.state_keys():
        add("state", (p, state), _state_key(p, state), *specs[p], trainer.zero_level > 0)
    for name, (shape, dtype) in zip(signature.buffer_names, signature.buffer_specs):
        add("buffer", name, _buffer_key(name), shape, dtype, False)
    saved_frozen = {f["name"] for f in meta.get("frozen", [])}
    for name, (shape, dtype) in zip(signature.frozen_names, signature.frozen_specs):
        if name in saved_frozen:  # an older checkpoint without them: the trainer keeps its own
            add("frozen", name, _param_key(name), shape, dtype, False)
    return reads


def load(trainer, path):
    """Trainer.load_checkpoint's reading: checks on every rank first (the same
    CheckpointError everywhere), then (params, states, buffers, frozen, meta) as numpy arrays
    for the trainer's world size: the parameters in signature order (full, or this rank's
    padded shard at level 3), {(param, state): array} (full, or this rank's padded shard
    under ZeRO), {name: full array} of the carried buffers and of the frozen parameters the
    checkpoint holds.

    Each rank checks the size of every file but the sha256 of only the files it reads, opens
    each of those once, and the ranks agree on the outcome (one allgather) before any data is
    read."""
    with trainer.comm.collective_work(f"loading checkpoint {path}", trainer.world > 1):
        return _read(trainer, path)


def _read(trainer, path):
    """load's collective part."""
    rank, world = _rank(trainer), trainer.world
    error, directory, meta = None, None, None
    try:
        directory = resolve(path)
        meta = read_meta(directory)
        check_compatible(meta, trainer.signature, trainer.optimizer)
        _check_frozen(meta, trainer.signature)
        reads = _reads(trainer, meta)
        numels = [int(np.prod(shape, dtype=np.int64)) for _, _, _, shape, *_ in reads]
        needed = set()
        for numel, (_, _, _, _, _, begin, end, _) in zip(numels, reads):
            needed |= files_for(meta, numel, begin, end)
        verify_files(directory, meta, needed)
    except CheckpointError as exc:
        error = str(exc)
    errors = (trainer.comm.agree(error, f"the agreement on checkpoint {path} before reading")
              if world > 1 else [error])
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        r, e = failed[0]
        raise raised_on_every_rank(CheckpointError(e if world == 1 else f"rank {r}: {e}"))
    out = {"param": {}, "state": {}, "buffer": {}, "frozen": {}}
    with OpenFiles(directory, meta) as files:
        for numel, (kind, name, key, shape, dtype, begin, end, shard) in zip(numels, reads):
            values = read_range(directory, meta, key, numel, begin, end, dtype, files)
            if shard is None:
                out[kind][name] = values.reshape(shape)
            else:  # this rank's padded shard
                out[kind][name] = np.zeros(shard, dtype=dtype)
                out[kind][name][:end - begin] = values
    params = [out["param"][p] for p in trainer.signature.param_names]
    return params, out["state"], out["buffer"], out["frozen"], meta
