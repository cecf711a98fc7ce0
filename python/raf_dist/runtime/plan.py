"""``dist.get_config()`` read once into what one Trainer runs (``RunPlan``), and the mesh it
runs on: the executors take the plan and never read the config again."""
import dataclasses
from typing import Any, Dict, Optional, Tuple

from ..distributed.mesh import ProcessMesh, check_mesh, get_mesh, local_mesh

#: the settings that decide whether and how the ranks train together (checked by every
#: Trainer of a world of several ranks: agreement.agree)
PARALLELISM_FIELDS = ("enable_data_parallel", "zero_opt_level", "tensor_parallel_size",
                      "pipeline_parallel_size", "embedding_parallel")


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """One Trainer's reading of the config.

    ``dp_size``: the mesh's data-parallel axis; ``data_parallel``: gradients reduced (and
    ZeRO's state sharded) over it (dp > 1, or ZeRO at any size); ``world``: the ranks that
    average gradients and shard state (``dp_size`` under data parallelism, else 1);
    ``spmd``: every rank of the world builds this Trainer and runs the same step together
    (otherwise the Trainer is this rank's own object)."""

    config: Dict[str, Any]
    local: bool
    tp: int
    pp: int
    zero_level: int
    dp_size: int
    data_parallel: bool
    world: int
    spmd: bool
    microbatches: int
    bucket_bytes: int
    overlap_comm: bool
    sync_batch_norm: bool
    schedule: str
    stages_per_rank: int
    split_points: Optional[Tuple[Any, ...]]
    activation_checkpointing: Optional[str]  # the recomputation policy: None, full, selective
    activation_memory_budget_mb: Optional[float]  # chooses the policy when set
    embedding_parallel: str = "none"  # "table" / "row": tables sharded over the dp ranks

    @property
    def embeddings_sharded(self) -> bool:
        """Tables sharded over several data-parallel ranks (passes/embedding_parallel.py)."""
        return self.embedding_parallel != "none" and self.data_parallel and self.world > 1

    @property
    def sync_batch_norm_world(self) -> int:
        """Ranks whose batch statistics are combined (synchronized batch norm), else 1."""
        return self.world if self.sync_batch_norm and self.data_parallel else 1


def plan_run(config: Any, world_size: int, local: bool = False) -> RunPlan:
    """The plan of a Trainer in a world of ``world_size`` ranks (checked: bad sizes raise,
    naming the fix, before any collective). ``local``: a Trainer of this rank alone."""
    config.check()
    config.check_supported()
    if local:
        check_local(config)
        world_size = 1
    tp, pp = int(config.tensor_parallel_size), int(config.pipeline_parallel_size)
    zero = int(config.zero_opt_level)
    dp_size = (check_mesh(world_size, tp, pp, config.enable_data_parallel) if tp > 1 or pp > 1
               else world_size)
    data_parallel = bool(config.enable_data_parallel) and (dp_size > 1 or zero > 0)
    schedule = config.pipeline_schedule
    return RunPlan(
        config=config.as_dict(), local=bool(local), tp=tp, pp=pp, zero_level=zero,
        dp_size=dp_size, data_parallel=data_parallel,
        world=dp_size if data_parallel else 1,
        spmd=world_size > 1 and (data_parallel or tp > 1 or pp > 1),
        microbatches=int(config.num_microbatches),
        bucket_bytes=max(1, int(config.bucket_size_mb * 2**20)),
        overlap_comm=bool(config.overlap_comm), sync_batch_norm=bool(config.sync_batch_norm),
        schedule=schedule,
        stages_per_rank=(int(config.pipeline_stages_per_rank)
                         if schedule == "interleaved_1f1b" else 1),
        split_points=config.pipeline_split_points,
        activation_checkpointing=config.recompute,
        activation_memory_budget_mb=config.activation_memory_budget_mb,
        embedding_parallel=config.embedding_parallel)


def build_mesh(plan: RunPlan, config: Any, world_size: int) -> ProcessMesh:
    """The mesh the plan runs on, always built: the world's (every axis's process group)
    when every rank runs this Trainer together or the world is one rank, else one of this
    rank alone (no group). Collective the first time in a world of several ranks."""
    if plan.spmd or (world_size == 1 and not plan.local):
        return get_mesh(config)
    return local_mesh()


def check_local(config: Any) -> None:
    """A ``local=True`` Trainer asks for no parallelism (it joins no collective)."""
    alone = {"enable_data_parallel": False, "zero_opt_level": 0, "tensor_parallel_size": 1,
             "pipeline_parallel_size": 1, "embedding_parallel": "none"}
    asked = {k: getattr(config, k) for k in PARALLELISM_FIELDS if getattr(config, k) != alone[k]}
    if asked:
        raise ValueError(
            f"Trainer(local=True) builds a Trainer of this rank alone, but the config asks "
            f"for parallelism ({', '.join(f'{k}={v!r}' for k, v in asked.items())}). Reset "
            "those fields (dist.get_config().update(...)) for the local Trainer, or build it "
            "on every rank without local=True")
