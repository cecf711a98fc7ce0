"""The device mesh as coordinates: the world as pp x dp x tp, tp innermost (DESIGN.md
section 1), and where pipeline stages live.

``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``, with ``dp = world / (tp * pp)``. Each axis
has one group per combination of the other two coordinates: this rank's tp group is the ``tp``
consecutive ranks that share its pp and dp coordinates, and so on. Pure arithmetic: the
process groups of these axes are ``raf_dist.distributed.mesh.ProcessMesh`` (a Mesh with
groups), built by ``dist.get_mesh()``.
"""
import dataclasses
from typing import List, Tuple

AXES = ("tp", "dp", "pp")


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _working_worlds(tp: int, pp: int, enable_data_parallel: bool, count: int = 4) -> List[int]:
    """-np values that split into tp x pp (and into dp > 1 only with data parallelism)."""
    unit = tp * pp
    if not enable_data_parallel:
        return [unit]
    return [unit * k for k in range(1, count + 1)]


def check_mesh(world: int, tp: int, pp: int, enable_data_parallel: bool) -> int:
    """The data-parallel size ``world / (tp * pp)``; raises ValueError, naming the problem and
    the fix, when the world does not split into pp x dp x tp or when dp > 1 without
    ``enable_data_parallel``. Pure: no communication."""
    _positive_int("world size", world)
    _positive_int("tensor_parallel_size", tp)
    _positive_int("pipeline_parallel_size", pp)
    unit = tp * pp
    if world % unit != 0:
        works = ", ".join(str(n) for n in _working_worlds(tp, pp, enable_data_parallel))
        more = "" if not enable_data_parallel else ", ..."
        raise ValueError(
            f"a world of {world} ranks does not split into pp x dp x tp with "
            f"tensor_parallel_size={tp} and pipeline_parallel_size={pp}: the world size must "
            f"be a multiple of tensor_parallel_size * pipeline_parallel_size = {unit}. "
            f"Launch with -np {works}{more}, or choose sizes whose product divides {world}")
    dp = world // unit
    if dp > 1 and not enable_data_parallel:
        raise ValueError(
            f"a world of {world} ranks with tensor_parallel_size={tp} and "
            f"pipeline_parallel_size={pp} leaves a data-parallel axis of {dp} ranks, but data "
            f"parallelism is off; set dist.get_config().enable_data_parallel = True, or make "
            f"tensor_parallel_size * pipeline_parallel_size == world ({world}), e.g. launch "
            f"with -np {unit}")
    return dp


def mesh_coordinates(rank: int, world: int, tp: int, pp: int) -> Tuple[int, int, int]:
    """``(pp_rank, dp_rank, tp_rank)`` of world rank ``rank``:
    ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank`` with ``dp = world / (tp * pp)``."""
    dp = check_mesh(world, tp, pp, enable_data_parallel=True)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in 0..{world - 1}, got {rank!r}")
    return rank // (dp * tp), (rank // tp) % dp, rank % tp


def axis_ranks(axis: str, pp_rank: int, dp_rank: int, tp_rank: int, pp: int, dp: int,
               tp: int) -> List[int]:
    """World ranks of the group along ``axis`` through the coordinates given, in group order."""
    if axis == "tp":
        return [(pp_rank * dp + dp_rank) * tp + t for t in range(tp)]
    if axis == "dp":
        return [(pp_rank * dp + d) * tp + tp_rank for d in range(dp)]
    if axis == "pp":
        return [(p * dp + dp_rank) * tp + tp_rank for p in range(pp)]
    raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(map(repr, AXES))}")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This rank's place in the pp x dp x tp mesh (a world of one included).

    Attributes:
        rank, world_size: position in and size of the world.
        tp_size, dp_size, pp_size: the axes' sizes (world = pp * dp * tp).
        tp_rank, dp_rank, pp_rank: this rank's coordinates (its position in each axis group).
    """

    rank: int
    world_size: int
    tp_size: int
    dp_size: int
    pp_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int

    @classmethod
    def of(cls, rank: int, world: int, tp: int = 1, pp: int = 1) -> "Mesh":
        """The mesh of world rank ``rank`` in a world of ``world`` ranks split tp x pp."""
        pp_rank, dp_rank, tp_rank = mesh_coordinates(rank, world, tp, pp)
        return cls(rank=rank, world_size=world, tp_size=tp, dp_size=world // (tp * pp),
                   pp_size=pp, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank)

    @classmethod
    def single(cls) -> "Mesh":
        """A world of one: every axis of size 1."""
        return cls.of(0, 1)

    def axis_ranks(self, axis: str) -> List[int]:
        """World ranks of this rank's group along ``axis`` ("tp", "dp" or "pp"), in group-rank
        order (this rank is at index ``<axis>_rank``)."""
        return axis_ranks(axis, self.pp_rank, self.dp_rank, self.tp_rank,
                           self.pp_size, self.dp_size, self.tp_size)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank {self.rank}/{self.world_size}: "
                f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size}, "
                f"tp {self.tp_rank}/{self.tp_size})")


def stage_rank(stage: int, pp_size: int) -> int:
    """The pp rank holding pipeline stage ``stage`` under the loop placement (interleaved
    schedules give a rank stages ``r, r + pp, r + 2 pp, ...``): ``stage % pp_size``."""
    for name, value, low in (("pp_size", pp_size, 1), ("stage", stage, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    return stage % pp_size
