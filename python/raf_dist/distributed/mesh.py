"""The device mesh: the world as pp x dp x tp, tp innermost (DESIGN.md section 1).

``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``, with ``dp = world / (tp * pp)``. Each axis
has one process group per combination of the other two coordinates: this rank's tp group is
the ``tp`` consecutive ranks that share its pp and dp coordinates, and so on.

``get_mesh()`` builds the groups once per (tensor_parallel_size, pipeline_parallel_size) and
registers each with the native collective runtime. A group is named by its native id (an int,
the ``group`` argument of ``raf_dist.ccl.*`` and of ``raf_dist.distributed.collectives``);
compiled IR embeds these ids, so every rank creates its groups in the same order and gets the
same ids. Ranks inside a group (``root``, ``src``, ``dst``) are positions in the group, i.e.
indices into ``Mesh.axis_ranks(axis)``, not world ranks.
"""
import dataclasses
import threading
from typing import Any, List, Tuple

from .. import _native
from .communicator import get_communicator
from .config import get_config

AXES = ("tp", "dp", "pp")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _working_worlds(tp, pp, enable_data_parallel, count=4):
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


def _axis_ranks(axis, pp_rank, dp_rank, tp_rank, pp, dp, tp) -> List[int]:
    if axis == "tp":
        return [(pp_rank * dp + dp_rank) * tp + t for t in range(tp)]
    if axis == "dp":
        return [(pp_rank * dp + d) * tp + tp_rank for d in range(dp)]
    if axis == "pp":
        return [(p * dp + dp_rank) * tp + tp_rank for p in range(pp)]
    raise ValueError(f"unknown mesh axis {axis!r}; the axes are {', '.join(map(repr, AXES))}")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """This rank's place in the pp x dp x tp mesh.

    Attributes:
        rank, world_size: position in and size of the world.
        tp_size, dp_size, pp_size: the axes' sizes (world = pp * dp * tp).
        tp_rank, dp_rank, pp_rank: this rank's coordinates (its position in each axis group).
        tp_group, dp_group, pp_group: native process-group ids of this rank's group along each
            axis (the ``group`` argument of ``raf_dist.ccl.*`` and of the collectives in
            ``raf_dist.distributed``); an axis spanning the whole world uses the world group.
        tp_comm, dp_comm, pp_comm: the matching mpi4py communicators, for Python-side control
            messages (not part of equality).
    """

    rank: int
    world_size: int
    tp_size: int
    dp_size: int
    pp_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_group: int
    dp_group: int
    pp_group: int
    tp_comm: Any = dataclasses.field(default=None, compare=False, repr=False)
    dp_comm: Any = dataclasses.field(default=None, compare=False, repr=False)
    pp_comm: Any = dataclasses.field(default=None, compare=False, repr=False)

    def axis_ranks(self, axis: str) -> List[int]:
        """World ranks of this rank's group along ``axis`` ("tp", "dp" or "pp"), in group-rank
        order (this rank is at index ``<axis>_rank``)."""
        return _axis_ranks(axis, self.pp_rank, self.dp_rank, self.tp_rank,
                           self.pp_size, self.dp_size, self.tp_size)

    def __repr__(self):
        return (f"Mesh(rank {self.rank}/{self.world_size}: pp {self.pp_rank}/{self.pp_size}, "
                f"dp {self.dp_rank}/{self.dp_size}, tp {self.tp_rank}/{self.tp_size})")


_LOCK = threading.Lock()
_MESHES = {}  # (tp, pp) -> Mesh


def _check_collectives():
    # the same switch get_communicator() hands the world group
    from .. import env

    return env.check_collectives()


def _split(world_comm, world_group, color, size, rank, check):
    """(native group id, mpi4py communicator) of ``color``'s ranks, ordered by world rank.
    Collective over the world; an axis spanning the world reuses the world group."""
    from mpi4py import MPI

    if size == world_comm.Get_size():
        return world_group, world_comm
    sub = world_comm.Split(color, key=rank)
    return int(_native.func("init_group")(MPI._addressof(sub), check)), sub


def get_mesh(config=None) -> Mesh:
    """This rank's :class:`Mesh` for ``config`` (default ``dist.get_config()``; any object with
    ``tensor_parallel_size``, ``pipeline_parallel_size`` and ``enable_data_parallel``).

    Collective the first time for each (tensor_parallel_size, pipeline_parallel_size): every
    rank must call it, in the same order relative to any other group creation. The sizes are
    checked (ValueError naming the fix) before any group is created; later calls return the
    cached mesh and create nothing.
    """
    if config is None:
        config = get_config()
    tp = config.tensor_parallel_size
    pp = config.pipeline_parallel_size
    enable_data_parallel = bool(config.enable_data_parallel)
    comm = get_communicator()
    dp = check_mesh(comm.size, tp, pp, enable_data_parallel)  # before any collective
    with _LOCK:
        mesh = _MESHES.get((tp, pp))
        if mesh is None:
            mesh = _build(comm, tp, dp, pp)
            _MESHES[(tp, pp)] = mesh
        return mesh


def _build(comm, tp, dp, pp):
    rank, world = comm.rank, comm.size
    pp_rank, dp_rank, tp_rank = mesh_coordinates(rank, world, tp, pp)
    check = _check_collectives()
    # Same order on every rank (tp, dp, pp), so the native ids agree everywhere.
    tp_group, tp_comm = _split(comm.mpi_comm, comm.group, pp_rank * dp + dp_rank, tp, rank, check)
    dp_group, dp_comm = _split(comm.mpi_comm, comm.group, pp_rank * tp + tp_rank, dp, rank, check)
    pp_group, pp_comm = _split(comm.mpi_comm, comm.group, dp_rank * tp + tp_rank, pp, rank, check)
    ids = (tp_group, dp_group, pp_group)
    if world > 1:
        everyone = comm.mpi_comm.allgather(ids)
        if any(other != ids for other in everyone):
            raise RuntimeError(
                f"rank {rank}: the mesh's native group ids differ across ranks "
                f"({dict(enumerate(everyone))}); every rank must create its process groups "
                "(get_communicator(), get_mesh()) in the same order")
    for axis, sub, size, position in (("tp", tp_comm, tp, tp_rank), ("dp", dp_comm, dp, dp_rank),
                                      ("pp", pp_comm, pp, pp_rank)):
        if (sub.Get_size(), sub.Get_rank()) != (size, position):  # pragma: no cover
            raise RuntimeError(f"rank {rank}: its {axis} group has it as rank {sub.Get_rank()} "
                               f"of {sub.Get_size()}, expected {position} of {size}")
    return Mesh(rank=rank, world_size=world, tp_size=tp, dp_size=dp, pp_size=pp,
                tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank,
                tp_group=tp_group, dp_group=dp_group, pp_group=pp_group,
                tp_comm=tp_comm, dp_comm=dp_comm, pp_comm=pp_comm)
