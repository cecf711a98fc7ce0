"""What each rank holds, as pure arithmetic (DESIGN.md section 2): the mesh's coordinates and
stage placement (``mesh``), the one sharding rule (``sharding``, pinned to the native
runtime's by tests/unit/test_layout.py) and the frozen ``StateLayout`` of a training step's
parameters and optimizer state (``state``) that the ZeRO pass, the executors, checkpoints,
``Trainer.stats()`` and the memory estimator all read. No MPI, no TVM."""
from .mesh import Mesh, axis_ranks, check_mesh, mesh_coordinates, stage_rank
from .sharding import local_shard, shard_size, slice_range
from .state import StateLayout, row_state_shape, state_layout, state_shape

__all__ = ["Mesh", "StateLayout", "axis_ranks", "check_mesh", "local_shard",
           "mesh_coordinates", "row_state_shape", "shard_size", "slice_range", "stage_rank",
           "state_layout", "state_shape"]
