"""``dist.get_config()`` read once into what one Trainer runs (``RunPlan``): its
``ParallelLayout`` (raf_dist.layout.parallel: every degree, this rank's coordinates, every
refusal) and the run's other settings (buckets, overlap, recomputation). The executors take
the plan and never read the config again; nothing here copies a field of the layout."""
import dataclasses
from typing import Any, Dict, Optional, Tuple

from ..layout.parallel import ParallelLayout
from ..layout.refusals import LOCAL_ALONE

#: the settings that decide whether and how the ranks train together (checked by every
#: Trainer of a world of several ranks: agreement.agree)
PARALLELISM_FIELDS = tuple(LOCAL_ALONE)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One Trainer's reading of the config: ``layout`` (how the ranks split the work) and the
    settings that are no degree of the mesh."""

    layout: ParallelLayout
    config: Dict[str, Any]
    bucket_bytes: int
    overlap_comm: bool
    sync_batch_norm: bool
    split_points: Optional[Tuple[Any, ...]]
    activation_checkpointing: Optional[str]  # the recomputation policy: None, full, selective
    activation_memory_budget_mb: Optional[float]  # chooses the policy when set

    @property
    def sync_batch_norm_world(self) -> int:
        """Ranks whose batch statistics are combined (synchronized batch norm), else 1."""
        return (self.layout.grad_world if self.sync_batch_norm and self.layout.data_parallel
                else 1)


def plan_run(config: Any, world_size: int, rank: int = 0, local: bool = False,
             model: Any = None, optimizer: Any = None) -> RunPlan:
    """The plan of a Trainer on rank ``rank`` of a world of ``world_size`` ranks, checked
    once (every row of ``raf_dist.layout.refusals.REFUSALS``, the model's with ``model`` and
    the optimizer's with ``optimizer``: bad sizes and combinations raise, naming the fix,
    before any collective). ``local``: a Trainer of this rank alone. Ranks that ask for no
    parallelism at all train independently: each its own world of one."""
    values = config.as_dict()
    alone = all(values[k] == v for k, v in LOCAL_ALONE.items())
    if alone and not local:
        world_size, rank = 1, 0
    layout = ParallelLayout.from_config(values, world_size, rank, local, model, optimizer)
    return RunPlan(
        layout=layout, config=values,
        bucket_bytes=max(1, int(config.bucket_size_mb * 2**20)),
        overlap_comm=bool(config.overlap_comm), sync_batch_norm=bool(config.sync_batch_norm),
        split_points=config.pipeline_split_points,
        activation_checkpointing=config.recompute,
        activation_memory_budget_mb=config.activation_memory_budget_mb)
