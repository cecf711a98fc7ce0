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

``files.py`` is the format; ``train_state.py``'s ``save`` and ``load`` write and read a
train state described by a ``TrainState`` (which element ranges this rank writes and reads
for the writers' number and ZeRO level), whatever executor holds it.
"""
from ..layout.sharding import shard_size, slice_range
from .files import (FORMAT, STALE_TMP_SECONDS, CheckpointError, OpenFiles, buffer_description,
                    buffer_key, check_compatible, files_for, finalize, frozen_description,
                    host_array, host_tag, model_description, param_key, read_meta, read_range,
                    resolve, state_key, step_of, temporary_name, verify_files, write_rank_file)
from .train_state import TrainState, load, save

__all__ = ["FORMAT", "STALE_TMP_SECONDS", "CheckpointError", "OpenFiles", "TrainState",
           "buffer_description", "buffer_key", "check_compatible", "files_for", "finalize",
           "frozen_description", "host_array", "host_tag", "load", "model_description",
           "param_key", "read_meta", "read_range", "resolve", "save", "shard_size",
           "slice_range", "state_key", "step_of", "temporary_name", "verify_files",
           "write_rank_file"]
