"""The device mesh's process groups: the world as pp x dp x tp, tp innermost (DESIGN.md
section 1; the coordinates are raf_dist.layout.mesh, pure arithmetic).

``get_mesh()`` builds the groups once per (tensor_parallel_size, pipeline_parallel_size) and
registers each with the native collective runtime. A group is named by its native id (an int,
the ``group`` argument of ``raf_dist.ccl.*`` and of ``raf_dist.distributed.collectives``);
compiled IR embeds these ids, so every rank creates its groups in the same order and gets the
same ids. Ranks inside a group (``root``, ``src``, ``dst``) are positions in the group, i.e.
indices into ``Mesh.axis_ranks(axis)``, not world ranks.
"""
import dataclasses
import threading
from typing import Any, Dict, Tuple

from .. import _native
from ..layout.mesh import AXES, Mesh, axis_ranks, check_mesh, mesh_coordinates
from . import settings
from .communicator import get_communicator
from .config import get_config

__all__ = ["AXES", "Mesh", "ProcessMesh", "check_mesh", "get_mesh", "local_mesh",
           "mesh_coordinates", "axis_ranks"]


@dataclasses.dataclass(frozen=True, repr=False)
class ProcessMesh(Mesh):
    """A :class:`raf_dist.layout.Mesh` (this rank's coordinates) with the process groups of
    its axes.

    Attributes (beyond Mesh's):
        tp_group, dp_group, pp_group: native process-group ids of this rank's group along each
            axis (the ``group`` argument of ``raf_dist.ccl.*`` and of the collectives in
            ``raf_dist.distributed``); an axis spanning the whole world uses the world group.
        tp_comm, dp_comm, pp_comm: the matching mpi4py communicators, for Python-side control
            messages (not part of equality).
    """

    tp_group: int = -1
    dp_group: int = -1
    pp_group: int = -1
    tp_comm: Any = dataclasses.field(default=None, compare=False, repr=False)
    dp_comm: Any = dataclasses.field(default=None, compare=False, repr=False)
    pp_comm: Any = dataclasses.field(default=None, compare=False, repr=False)


_LOCK = threading.Lock()
_MESHES: Dict[Tuple[int, int], ProcessMesh] = {}  # (tp, pp) -> mesh


def _split(world_comm, world_group, color, size, rank, check):
    """(native group id, mpi4py communicator) of ``color``'s ranks, ordered by world rank.
    Collective over the world; an axis spanning the world reuses the world group."""
    from mpi4py import MPI

    if size == world_comm.Get_size():
        return world_group, world_comm
    sub = world_comm.Split(color, key=rank)
    return int(_native.func("init_group")(MPI._addressof(sub), check)), sub


def get_mesh(config: Any = None) -> ProcessMesh:
    """This rank's :class:`ProcessMesh` for ``config`` (default ``dist.get_config()``; any object with
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
    check = settings.check_collectives()  # the switch get_communicator() gave the world
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
    return ProcessMesh(rank=rank, world_size=world, tp_size=tp, dp_size=dp, pp_size=pp,
                tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank,
                tp_group=tp_group, dp_group=dp_group, pp_group=pp_group,
                tp_comm=tp_comm, dp_comm=dp_comm, pp_comm=pp_comm)


def local_mesh() -> ProcessMesh:
    """The mesh of a rank working alone (a world of one: ``Trainer(local=True)``, or ranks
    that all train independently): every axis of size 1, no process group (a collective on
    one of its groups is an error, and none is made)."""
    return ProcessMesh(rank=0, world_size=1, tp_size=1, dp_size=1, pp_size=1, tp_rank=0,
                       dp_rank=0, pp_rank=0)
