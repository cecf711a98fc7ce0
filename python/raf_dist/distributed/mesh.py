"""The device mesh's process groups: the world as pp x dp x cp x tp, tp innermost (DESIGN.md
section 1; the coordinates and every group's ranks are ``raf_dist.layout.ParallelLayout``,
pure arithmetic).

``get_mesh()`` builds the groups once per mesh shape and registers each with the native
collective runtime. A group is named by its native id (an int, the ``group`` argument of
``raf_dist.ccl.*`` and of ``raf_dist.distributed.collectives``); compiled IR embeds these ids,
so every rank creates its groups in the same order and gets the same ids. Ranks inside a
group (``root``, ``src``, ``dst``) are positions in the group, i.e. indices into
``mesh.axis_ranks(axis)``, not world ranks.
"""
import threading
from typing import Any, Dict, List, Optional, Tuple

from .. import _native
from ..layout.parallel import AXES, ParallelLayout, check_mesh, mesh_coordinates
from . import settings
from .communicator import get_communicator
from .config import get_config

__all__ = ["AXES", "ProcessMesh", "check_mesh", "get_mesh", "local_mesh", "mesh_coordinates"]


class ProcessMesh:
    """This rank's place in the mesh (its :class:`raf_dist.layout.ParallelLayout`, read
    through, never copied) with the process groups of its axes.

    Attributes:
        layout: the ParallelLayout (degrees, coordinates, group ranks).
        rank, world_size, tp_size, dp_size, cp_size, pp_size, ep_size, tp_rank, dp_rank,
            cp_rank, pp_rank, ep_rank: the layout's, by the names of the contract.
        tp_group, dp_group, cp_group, pp_group: native process-group ids of this rank's group
            along each axis (the ``group`` argument of ``raf_dist.ccl.*`` and of the
            collectives in ``raf_dist.distributed``); an axis spanning the whole world uses
            the world group; -1 where no group was made (a mesh of one rank alone, or a cp
            axis of size 1).
        tp_comm, dp_comm, cp_comm, pp_comm: the matching mpi4py communicators, for Python-side
            control messages.
    """

    def __init__(self, layout: ParallelLayout, groups: Optional[Dict[str, int]] = None,
                 comms: Optional[Dict[str, Any]] = None) -> None:
        self.layout = layout
        self._groups = dict(groups or {})
        self._comms = dict(comms or {})

    # the contract's names, read through the layout
    rank = property(lambda self: self.layout.rank)
    world_size = property(lambda self: self.layout.world)
    tp_size = property(lambda self: self.layout.tp)
    dp_size = property(lambda self: self.layout.dp)
    cp_size = property(lambda self: self.layout.cp)
    pp_size = property(lambda self: self.layout.pp)
    ep_size = property(lambda self: self.layout.ep)
    tp_rank = property(lambda self: self.layout.tp_rank)
    dp_rank = property(lambda self: self.layout.dp_rank)
    cp_rank = property(lambda self: self.layout.cp_rank)
    pp_rank = property(lambda self: self.layout.pp_rank)
    ep_rank = property(lambda self: self.layout.ep_rank)
    tp_group = property(lambda self: self._groups.get("tp", -1))
    dp_group = property(lambda self: self._groups.get("dp", -1))
    cp_group = property(lambda self: self._groups.get("cp", -1))
    pp_group = property(lambda self: self._groups.get("pp", -1))
    tp_comm = property(lambda self: self._comms.get("tp"))
    dp_comm = property(lambda self: self._comms.get("dp"))
    cp_comm = property(lambda self: self._comms.get("cp"))
    pp_comm = property(lambda self: self._comms.get("pp"))

    @property
    def grad_group(self) -> int:
        """The native id of the group gradients average over and ZeRO shards across: the dp
        group, or with context parallelism dp x cp (the cp group when dp is 1)."""
        if self.layout.cp == 1:
            return self.dp_group
        return self._groups.get("grad", self.cp_group)

    @property
    def grad_comm(self) -> Any:
        """The mpi4py communicator of ``grad_group``."""
        if self.layout.cp == 1:
            return self.dp_comm
        return self._comms.get("grad", self.cp_comm)

    def axis_ranks(self, axis: str) -> List[int]:
        """World ranks of this rank's group along ``axis``, in group-rank order."""
        return self.layout.group_ranks(axis)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ProcessMesh) and self.layout == other.layout
                and self._groups == other._groups)

    def __hash__(self) -> int:
        return hash((self.layout, tuple(sorted(self._groups.items()))))

    def __repr__(self) -> str:
        return f"ProcessMesh({self.layout!r})"


_LOCK = threading.Lock()
_MESHES: Dict[Tuple[int, ...], ProcessMesh] = {}  # (pp, cp, tp) -> mesh


def _split(world_comm: Any, world_group: int, color: int, size: int, rank: int,
           check: bool) -> Tuple[int, Any]:
    """(native group id, mpi4py communicator) of ``color``'s ranks, ordered by world rank.
    Collective over the world; an axis spanning the world reuses the world group."""
    from mpi4py import MPI

    if size == world_comm.Get_size():
        return world_group, world_comm
    sub = world_comm.Split(color, key=rank)
    return int(_native.func("init_group")(MPI._addressof(sub), check)), sub


def get_mesh(config: Any = None) -> ProcessMesh:
    """This rank's :class:`ProcessMesh` for ``config`` (default ``dist.get_config()``; any
    object with ``tensor_parallel_size``, ``pipeline_parallel_size`` and
    ``enable_data_parallel``, optionally ``context_parallel_size``).

    Collective the first time for each mesh shape: every rank must call it, in the same order
    relative to any other group creation. The sizes are checked (ValueError naming the fix)
    before any group is created; later calls return the cached mesh and create nothing.
    """
    if config is None:
        config = get_config()
    tp = config.tensor_parallel_size
    pp = config.pipeline_parallel_size
    cp = getattr(config, "context_parallel_size", 1)
    comm = get_communicator()
    layout = ParallelLayout.build(comm.size, comm.rank, tp=tp, pp=pp, cp=cp,
                                  enable_data_parallel=bool(config.enable_data_parallel))
    return _groups_of(layout, comm)


def _groups_of(layout: ParallelLayout, comm: Any) -> ProcessMesh:
    """The world's groups of ``layout``'s shape: built the first time for each shape (collective),
    the cached mesh after."""
    with _LOCK:
        key = (layout.pp, layout.cp, layout.tp)
        mesh = _MESHES.get(key)
        if mesh is None:
            mesh = _MESHES[key] = _build(comm, layout)
        return mesh


def mesh_for(layout: ParallelLayout) -> ProcessMesh:
    """The mesh a Trainer of ``layout`` runs on: the world's groups (collective the first
    time for its shape) when its ranks run together or the job is one rank, else one of this
    rank alone (no group: ``Trainer(local=True)``, or ranks that each train on their own)."""
    comm = get_communicator()
    if layout.spmd or (comm.size == 1 and not layout.local):
        mesh = _groups_of(layout, comm)
        return ProcessMesh(layout, mesh._groups, mesh._comms)
    return local_mesh(layout)


def _build(comm: Any, layout: ParallelLayout) -> ProcessMesh:
    rank, world = comm.rank, comm.size
    check = settings.check_collectives()  # the switch get_communicator() gave the world
    groups: Dict[str, int] = {}
    comms: Dict[str, Any] = {}
    # Same order on every rank (tp, dp, pp, then cp where it exists), so the native ids
    # agree everywhere; a cp group of one rank is not made (its collectives would be no-ops)
    for axis in ("tp", "dp", "pp", "cp"):
        if axis == "cp" and layout.cp == 1:
            continue
        groups[axis], comms[axis] = _split(comm.mpi_comm, comm.group, layout.group_color(axis),
                                           layout.size(axis), rank, check)
    if layout.cp > 1 and layout.dp > 1:  # gradients average over dp x cp
        groups["grad"], comms["grad"] = _split(comm.mpi_comm, comm.group, layout.grad_color(),
                                               layout.dp * layout.cp, rank, check)
    ids = tuple(groups.values())
    if world > 1:
        everyone = comm.mpi_comm.allgather(ids)
        if any(other != ids for other in everyone):
            raise RuntimeError(
                f"rank {rank}: the mesh's native group ids differ across ranks "
                f"({dict(enumerate(everyone))}); every rank must create its process groups "
                "(get_communicator(), get_mesh()) in the same order")
    for axis, sub in comms.items():
        expected = ((layout.dp * layout.cp, layout.grad_rank) if axis == "grad" else
                    (layout.size(axis), layout.coordinate(axis)))
        if (sub.Get_size(), sub.Get_rank()) != expected:  # pragma: no cover
            raise RuntimeError(f"rank {rank}: its {axis} group has it as rank {sub.Get_rank()} "
                               f"of {sub.Get_size()}, expected {expected[1]} of {expected[0]}")
    return ProcessMesh(layout, groups, comms)


def local_mesh(layout: Optional[ParallelLayout] = None) -> ProcessMesh:
    """The mesh of a rank working alone (a world of one: ``Trainer(local=True)``, or ranks
    that all train independently): every axis of size 1, no process group (a collective on
    one of its groups is an error, and none is made)."""
    return ProcessMesh(layout if layout is not None and layout.world == 1
                       else ParallelLayout.single())
