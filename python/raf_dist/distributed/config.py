"""The distribution switches a user script flips before building a Trainer.

The Trainer reads this object once and turns it into explicit pass arguments; no pass reads it
(DESIGN.md section 2). Every assignment is validated at once, so a typo or a bad value fails
on the line that wrote it, long before any collective starts.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..layout.refusals import check_values

_ZERO_LEVELS = (0, 1, 2, 3)
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
CONTEXT_PARALLEL_METHODS = ("ring", "alltoall")
EMBEDDING_MODES = ("none", "table", "row")


@dataclasses.dataclass
class DistConfig:
    """Distribution settings.

    Attributes:
        enable_data_parallel: average gradients across ranks (DP / ZeRO). Default False.
        zero_opt_level: 0 (plain DP), 1 (shard optimizer state), 2 (+ shard gradients),
            3 (+ shard parameters). Levels above 0 require data parallelism.
        bucket_size_mb: gradient bucket size for the collectives, in MB (> 0). Default 25.
        overlap_comm: start each bucket's collective as soon as it is ready. Default True.
        sync_batch_norm: batch norm statistics of the global batch (summed across the
            data-parallel ranks, as torch.nn.SyncBatchNorm) instead of each rank's own batch.
            Default False (DDP's default: local statistics, rank 0's running statistics kept).
        tensor_parallel_size, pipeline_parallel_size: the tp and pp axes of the
            pp x dp x cp x tp mesh (DESIGN.md section 1; ints >= 1, default 1).
        context_parallel_size: the cp axis (one sequence split over cp ranks; int >= 1,
            default 1). Validated; above 1 the Trainer refuses it until context parallelism
            is built (raf_dist.layout.refusals.REFUSALS).
        context_parallel_method: "ring" (default) or "alltoall" (Ulysses).
        expert_parallel_size: experts split over ep consecutive dp ranks (int >= 1, default
            1; divides the dp size). Above 1 refused until expert parallelism is built.
        sequence_parallel: Megatron's sequence parallelism over the tp ranks (needs
            tensor_parallel_size > 1; default False). Refused until it is built.
        num_microbatches: microbatches per step (pipelining / gradient accumulation; >= 1).
        pipeline_schedule: "gpipe", "1f1b" (default), "interleaved_1f1b" or "zero_bubble"
            (validated, not built: the Trainer refuses it under pipelining).
        pipeline_stages_per_rank: stages per pp rank under "interleaved_1f1b" (>= 2, default
            2; GPipe and 1F1B hold one stage per rank).
        pipeline_split_points: None (the partitioner balances the stages) or the module
            names where stages 1 .. S-1 start, e.g. ["layers.4"] (S - 1 names).
        activation_checkpointing: recompute activations in backward instead of keeping them
            (passes/remat.py). False (default); True or "full": keep each block's input
            (blocks end at residual joins) and recompute the rest of the block; "selective":
            keep the outputs of matmuls and convolutions, recompute the cheap work between
            them. Results are identical either way. Under pipelining, True / "full" make each
            stage keep only its input per microbatch and run its forward again in backward.
        activation_memory_budget_mb: None (default) or the MB the step's planned temporaries
            (activations and workspace; not parameters, gradients held between steps or
            optimizer state) may take: the compiler picks the least recomputation whose
            planned peak fits, from none through "selective"'s values one at a time (lowest
            recompute cost per byte first) to "selective", then "full"'s blocks one at a time
            to "full", or the Trainer says at construction the smallest peak it can reach.
            Replaces activation_checkpointing's choice. Under pipelining the choice is per
            stage (none, "selective" or "full"), for the rank's activation memory: the saved
            values of the microbatches its stages hold in flight at the schedule's peak plus
            the largest stage's planned temporaries (runtime/stage_budget.py).
        embedding_parallel: "none" (default: embedding tables replicated like any
            parameter), "table" (each table whole on one rank of the dp group, placed by
            bytes or by Trainer(embedding_plan=...)) or "row" (each table's rows split over
            the dp group): ids and rows travel by all-to-all, the dense layers stay data
            parallel (passes/embedding_parallel.py). Requires enable_data_parallel.

    The failure-handling settings of the runtime (read once, when the process joins the job:
    set them before the first ``get_communicator()`` or Trainer; the
    RAF_DIST_* environment variable of the same name overrides each, see raf_dist/env.py):
        collective_timeout_s: seconds a collective may wait before raising TimeoutError
            (default 600, torch's NCCL default; 0 = forever).
        barrier_timeout_s: seconds a compile / checkpoint barrier or agreement may wait
            (default 3600; 0 = forever).
        check_collectives: ranks compare every collective's signature first. Default False.
        watchdog: a per-rank watchdog process names a rank that dies silently and ends the
            others. Default True.
        watchdog_grace_s: seconds a watchdog lets the launcher end its rank after a failure
            elsewhere before it terminates the rank (default 10).

    The mesh fields are part of the public contract and validated here, each field on
    assignment; every refusal of a combination is one row of
    ``raf_dist.layout.refusals.REFUSALS`` (the fields' rules on ``update``, the rest when a
    Trainer builds its ``ParallelLayout``), raised with an error naming the field and the fix
    before anything starts. Pipelining runs gpipe, 1f1b and interleaved_1f1b schedules;
    without pipelining ``num_microbatches`` runs as gradient accumulation.
    """

    enable_data_parallel: bool = False
    zero_opt_level: int = 0
    bucket_size_mb: float = 25.0
    overlap_comm: bool = True
    sync_batch_norm: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    context_parallel_method: str = "ring"
    expert_parallel_size: int = 1
    sequence_parallel: bool = False
    num_microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_stages_per_rank: int = 2
    pipeline_split_points: list[str] | None = None
    activation_checkpointing: bool | str = False
    activation_memory_budget_mb: float | None = None
    embedding_parallel: str = "none"
    collective_timeout_s: float = 600.0
    barrier_timeout_s: float = 3600.0
    check_collectives: bool = False
    watchdog: bool = True
    watchdog_grace_s: float = 10.0

    def __setattr__(self, name: str, value: Any) -> None:
        fields = {f.name for f in dataclasses.fields(self)}
        if name not in fields:
            raise AttributeError(
                f"DistConfig has no field {name!r}; the fields are: {', '.join(sorted(fields))}"
            )
        value = _validate(name, value)
        if name in RUNTIME_FIELDS and _STARTED and value != getattr(self, name):
            raise ValueError(
                f"{name} is read when the process joins the job, which already happened (it is "
                f"{getattr(self, name)!r}); set dist.get_config().{name} before the first "
                "get_communicator() or Trainer, or set "
                f"RAF_DIST_{name.upper()} in the environment")
        object.__setattr__(self, name, value)

    def update(self, values: Mapping[str, Any]) -> DistConfig:
        """Set several fields from a mapping (e.g. a script's ``raf_dist_config`` dict)."""
        for name, value in dict(values).items():
            setattr(self, name, value)
        self.check()
        return self

    def check(self) -> None:
        """Cross-field rules, checked on every ``update`` and by the Trainer before it builds
        anything (the "config" rows of ``raf_dist.layout.refusals.REFUSALS``)."""
        check_values(self.as_dict(), kinds=("config",))

    def check_supported(self) -> None:
        """Refuse the contract's values this version cannot run yet (the "built" rows of
        ``raf_dist.layout.refusals.REFUSALS``; the Trainer calls it before any collective):
        naming the field beats training something else silently."""
        check_values(self.as_dict(), kinds=("built",))

    @property
    def recompute(self) -> str | None:
        """The recomputation policy activation_checkpointing asks for: None, "full" or
        "selective"."""
        value = self.activation_checkpointing
        return "full" if value is True else (value or None)

    def reset(self) -> DistConfig:
        """Back to the defaults (tests use this between cases)."""
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, field.default)
        return self

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: the fields the runtime reads once, when the process joins the job (raf_dist/env.py)
RUNTIME_FIELDS = ("collective_timeout_s", "barrier_timeout_s", "check_collectives", "watchdog",
                  "watchdog_grace_s")
_STARTED = False


def runtime_started() -> None:
    """The communicator exists: the RUNTIME_FIELDS are in force and may no longer change."""
    global _STARTED
    _STARTED = True


def _validate(name: str, value: Any) -> Any:
    if name in ("collective_timeout_s", "barrier_timeout_s", "watchdog_grace_s"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                value >= 0 and value != float("inf")) or (name == "watchdog_grace_s"
                                                          and value == 0):
            forever = "" if name == "watchdog_grace_s" else ", or 0 to wait forever"
            raise ValueError(f"{name} must be a number of seconds{forever}, got {value!r}")
        return float(value)
    if name == "activation_memory_budget_mb":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise ValueError(f"activation_memory_budget_mb must be None or a number of MB > 0, "
                             f"got {value!r}")
        return None if value is None else float(value)
    if name == "activation_checkpointing":
        if not (isinstance(value, bool) or value in ("full", "selective")):
            raise ValueError(f"activation_checkpointing must be False, True, 'full' or "
                             f"'selective', got {value!r}")
        return value
    if name in ("enable_data_parallel", "overlap_comm", "sync_batch_norm",
                "check_collectives", "watchdog", "sequence_parallel"):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
        return value
    if name == "zero_opt_level":
        if isinstance(value, bool) or value not in _ZERO_LEVELS:
            raise ValueError(
                f"zero_opt_level must be one of {_ZERO_LEVELS} (0 = plain data parallel, "
                f"1 = optimizer state, 2 = + gradients, 3 = + parameters), got {value!r}"
            )
        return int(value)
    if name in ("tensor_parallel_size", "pipeline_parallel_size", "num_microbatches",
                "context_parallel_size", "expert_parallel_size"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        return int(value)
    if name == "pipeline_stages_per_rank":
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"pipeline_stages_per_rank must be an int >= 2 (it applies to "
                             f"interleaved_1f1b), got {value!r}")
        return int(value)
    if name == "pipeline_split_points":
        if value is None:
            return None
        if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"pipeline_split_points must be None or a list of module names "
                             f"(e.g. ['layers.4']), got {value!r}")
        return list(value)
    if name == "embedding_parallel":
        if value not in EMBEDDING_MODES:
            raise ValueError(f"embedding_parallel must be one of {EMBEDDING_MODES}, got "
                             f"{value!r}")
        return value
    if name == "context_parallel_method":
        if value not in CONTEXT_PARALLEL_METHODS:
            raise ValueError(f"context_parallel_method must be one of "
                             f"{CONTEXT_PARALLEL_METHODS}, got {value!r}")
        return value
    if name == "pipeline_schedule":
        if value not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got "
                             f"{value!r}")
        return value
    if name == "bucket_size_mb":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"bucket_size_mb must be a positive number of MB, got {value!r}")
        return float(value)
    return value


_CONFIG = DistConfig()


def get_config() -> DistConfig:
    """The process-wide distribution config (a singleton, like RAF's ``dist.get_config()``)."""
    return _CONFIG
