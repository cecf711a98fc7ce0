"""How the ranks split the work and what each holds, as pure arithmetic (DESIGN.md section
2): the ``ParallelLayout`` (``parallel``: every degree of the pp x dp x cp x tp mesh, this
rank's coordinates, each axis's group ranks, and every refusal of a combination), the one
sharding rule (``sharding``, pinned to the native runtime's by tests/unit/test_layout.py) and
the frozen ``StateLayout`` of a training step's parameters and optimizer state (``state``)
that the ZeRO pass, the executors, checkpoints, ``Trainer.stats()`` and the memory estimator
all read. No MPI, no TVM."""
from .parallel import ParallelLayout, check_mesh, mesh_coordinates, stage_rank
from .sharding import local_shard, shard_size, slice_range
from .state import StateLayout, row_state_shape, state_layout, state_shape

__all__ = ["ParallelLayout", "StateLayout", "check_mesh", "local_shard", "mesh_coordinates",
           "row_state_shape", "shard_size", "slice_range", "stage_rank", "state_layout",
           "state_shape"]
