"""One ``ParallelLayout``: how a job's ranks split the work, as pure arithmetic (DESIGN.md
section 2, the torchtitan ``ParallelDims`` idea).

The world is a pp x dp x cp x tp mesh, tp innermost (DESIGN.md section 1)::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

with ``dp = world / (pp * cp * tp)``; experts split over dp (``ep`` consecutive dp ranks form
an ep group, ``ep_rank = dp_rank % ep``). Each axis has one group per combination of the other
coordinates: this rank's tp group is the ``tp`` consecutive ranks that share its pp, dp and cp
coordinates, and so on. ``distributed.mesh`` builds the process groups from
``ParallelLayout.group_ranks`` / ``group_color``; nothing here talks to MPI.

Built once per Trainer from the DistConfig's values and the world size
(``ParallelLayout.from_config``), it is what executors, passes' arguments, checkpoints,
``stats()`` and the planner's mesh specs read: nobody copies its fields. Every refusal of a
combination is one row of ``layout.refusals.REFUSALS`` (checked by ``from_config`` and
``validate``); each message names the problem and the fix, and is raised before any
collective.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Tuple

from .refusals import CONFIG_FIELDS, Case, check, check_values

#: the mesh axes, outermost first (the rank formula's order); "ep" splits dp, it is no
#: axis of its own
AXES = ("pp", "dp", "cp", "tp")
SCHEDULES_BUILT = ("gpipe", "1f1b", "interleaved_1f1b")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _mesh_words(cp: int) -> str:
    return "pp x dp x cp x tp" if cp > 1 else "pp x dp x tp"


def check_mesh(world: int, tp: int, pp: int, enable_data_parallel: bool, cp: int = 1) -> int:
    """The data-parallel size ``world / (pp * cp * tp)``; raises ValueError, naming the
    problem and the fix, when the world does not split into the mesh or when dp > 1 without
    ``enable_data_parallel``. Pure: no communication."""
    _positive_int("world size", world)
    _positive_int("tensor_parallel_size", tp)
    _positive_int("pipeline_parallel_size", pp)
    _positive_int("context_parallel_size", cp)
    unit = tp * pp * cp
    sizes = (f"tensor_parallel_size={tp} and pipeline_parallel_size={pp}" if cp == 1 else
             f"tensor_parallel_size={tp}, context_parallel_size={cp} and "
             f"pipeline_parallel_size={pp}")
    product = ("tensor_parallel_size * pipeline_parallel_size" if cp == 1 else
               "tensor_parallel_size * context_parallel_size * pipeline_parallel_size")
    if world % unit != 0:
        works = ", ".join(str(unit * k) for k in range(1, 5 if enable_data_parallel else 2))
        more = ", ..." if enable_data_parallel else ""
        raise ValueError(
            f"a world of {world} ranks does not split into {_mesh_words(cp)} with {sizes}: "
            f"the world size must be a multiple of {product} = {unit}. Launch with -np "
            f"{works}{more}, or choose sizes whose product divides {world}")
    dp = world // unit
    if dp > 1 and not enable_data_parallel:
        raise ValueError(
            f"a world of {world} ranks with {sizes} leaves a data-parallel axis of {dp} "
            f"ranks, but data parallelism is off; set dist.get_config().enable_data_parallel "
            f"= True, or make {product} == world ({world}), e.g. launch with -np {unit}")
    return dp


def mesh_coordinates(rank: int, world: int, tp: int, pp: int,
                     cp: int = 1) -> Tuple[int, ...]:
    """``(pp_rank, dp_rank, tp_rank)`` of world rank ``rank`` (``(pp_rank, dp_rank, cp_rank,
    tp_rank)`` when ``cp`` > 1), by the rank formula."""
    dp = check_mesh(world, tp, pp, enable_data_parallel=True, cp=cp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in 0..{world - 1}, got {rank!r}")
    pp_i, rest = divmod(rank, dp * cp * tp)
    dp_i, rest = divmod(rest, cp * tp)
    cp_i, tp_i = divmod(rest, tp)
    return (pp_i, dp_i, tp_i) if cp == 1 else (pp_i, dp_i, cp_i, tp_i)


def stage_rank(stage: int, pp_size: int) -> int:
    """The pp rank holding pipeline stage ``stage`` under the loop placement (interleaved
    schedules give a rank stages ``r, r + pp, r + 2 pp, ...``): ``stage % pp_size``."""
    for name, value, low in (("pp_size", pp_size, 1), ("stage", stage, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    return stage % pp_size


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """How the ranks of one Trainer's job split the work (frozen: built once).

    Degrees: ``pp``, ``dp``, ``cp``, ``tp`` (world = pp * dp * cp * tp) and ``ep`` (expert
    groups over dp). ``rank`` / ``world``: this rank in the job (0 / 1 for a Trainer of one
    rank alone: ``local``, or ranks that each train independently). The settings that decide
    what the axes carry: ``enable_data_parallel``, ``zero_level``, ``microbatches``,
    ``schedule``, ``stages_per_rank``, ``sequence_parallel``, ``embedding_parallel``,
    ``context_parallel_method``.
    """

    world: int = 1
    rank: int = 0
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    enable_data_parallel: bool = False
    zero_level: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    sequence_parallel: bool = False
    context_parallel_method: str = "ring"
    embedding_parallel: str = "none"
    local: bool = False

    @classmethod
    def build(cls, world: int = 1, rank: int = 0, *, tp: int = 1, pp: int = 1, cp: int = 1,
              ep: int = 1, enable_data_parallel: bool = False, zero_level: int = 0,
              microbatches: int = 1, schedule: str = "1f1b", stages_per_rank: int = 2,
              sequence_parallel: bool = False, context_parallel_method: str = "ring",
              embedding_parallel: str = "none", local: bool = False) -> ParallelLayout:
        """The layout of world rank ``rank`` (checked: a world that does not split, or dp > 1
        without data parallelism, raises ValueError naming the fix). ``stages_per_rank``
        applies to interleaved_1f1b only (1 otherwise)."""
        dp = check_mesh(world, tp, pp, enable_data_parallel, cp)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in 0..{world - 1}, got {rank!r}")
        return cls(world=world, rank=rank, pp=pp, dp=dp, cp=cp, tp=tp, ep=int(ep),
                   enable_data_parallel=bool(enable_data_parallel), zero_level=int(zero_level),
                   microbatches=int(microbatches), schedule=schedule,
                   stages_per_rank=int(stages_per_rank) if schedule == "interleaved_1f1b"
                   else 1, sequence_parallel=bool(sequence_parallel),
                   context_parallel_method=context_parallel_method,
                   embedding_parallel=embedding_parallel, local=bool(local))

    @classmethod
    def from_config(cls, values: Mapping[str, Any], world: int, rank: int = 0,
                    local: bool = False, model: Any = None,
                    optimizer: Any = None) -> ParallelLayout:
        """The layout ``values`` (a DistConfig's ``as_dict()``) give world rank ``rank`` of
        ``world``; with ``local`` a world of this rank alone, which must ask for no
        parallelism. Every refusal is checked once, in the table's order, with ``model``'s
        and ``optimizer``'s rows when they are given: the fields' rows, the model's and the
        optimizer's before the mesh's sizes, then the rows that need the world."""
        check_values(values, local=local, model=model, optimizer=optimizer)
        if local:
            world, rank = 1, 0
        layout = cls.build(world, rank, local=local, **{
            attr: values[field] for field, attr in CONFIG_FIELDS.items() if field in values})
        check(Case(layout, None, model, optimizer), ("world",))
        return layout

    @classmethod
    def single(cls) -> ParallelLayout:
        """A world of one: every axis of size 1, no parallelism."""
        return cls()

    # ---- this rank's coordinates (the rank formula) -----------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert group (``ep`` consecutive dp ranks)."""
        return self.dp_rank % self.ep

    def size(self, axis: str) -> int:
        """The degree of mesh axis ``axis`` ("pp", "dp", "cp", "tp")."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}[_axis(axis)]

    def coordinate(self, axis: str) -> int:
        """This rank's position along ``axis`` (its rank in that axis's group)."""
        return {"pp": self.pp_rank, "dp": self.dp_rank, "cp": self.cp_rank,
                "tp": self.tp_rank}[_axis(axis)]

    def rank_at(self, pp: int, dp: int, cp: int, tp: int) -> int:
        """The world rank at mesh coordinates (pp, dp, cp, tp)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group_ranks(self, axis: str) -> List[int]:
        """World ranks of this rank's group along ``axis``, in group-rank order (this rank
        is at index ``coordinate(axis)``)."""
        here = {a: self.coordinate(a) for a in AXES}
        return [self.rank_at(**{**here, _axis(axis): i}) for i in range(self.size(axis))]

    def group_color(self, axis: str) -> int:
        """An int naming this rank's group along ``axis`` (equal for the ranks of one group,
        distinct across groups: the other coordinates, mixed-radix), for ``comm.Split``."""
        color = 0
        for other in AXES:
            if other != _axis(axis):
                color = color * self.size(other) + self.coordinate(other)
        return color

    def expert_group_ranks(self) -> List[int]:
        """World ranks of this rank's expert group: ``ep`` consecutive dp ranks, same pp,
        cp and tp coordinates."""
        first = self.dp_rank - self.ep_rank
        return [self.rank_at(self.pp_rank, first + e, self.cp_rank, self.tp_rank)
                for e in range(self.ep)]

    # ---- what the degrees mean (the executors and passes ask these) -------------------------
    @property
    def data_parallel(self) -> bool:
        """Gradients reduced (and ZeRO's state sharded) over the gradient group: data
        parallelism on and dp > 1, or ZeRO at any size; or context parallelism (each cp
        rank's gradients are those of its tokens, averaged over the cp ranks whether or not
        data parallelism is on)."""
        return (self.enable_data_parallel and (self.dp > 1 or self.zero_level > 0)) or \
            self.cp > 1

    @property
    def grad_world(self) -> int:
        """The ranks that average gradients and shard state: the gradient group, dp (under
        data parallelism) x cp."""
        if not self.data_parallel:
            return 1
        return (self.dp if self.enable_data_parallel else 1) * self.cp

    @property
    def grad_rank(self) -> int:
        """This rank's place in the gradient group (dp x cp, cp inner)."""
        return (self.dp_rank if self.enable_data_parallel else 0) * self.cp + self.cp_rank

    def grad_group_ranks(self) -> List[int]:
        """World ranks of this rank's gradient group (same pp and tp coordinates), in
        ``grad_rank`` order."""
        return [self.rank_at(self.pp_rank, d, c, self.tp_rank)
                for d in range(self.dp) for c in range(self.cp)]

    def grad_color(self) -> int:
        """An int naming this rank's gradient group (its pp and tp coordinates)."""
        return self.pp_rank * self.tp + self.tp_rank

    @property
    def spmd(self) -> bool:
        """Every rank of the world builds this Trainer and runs the same step together
        (otherwise the Trainer is this rank's own object)."""
        return self.world > 1 and (self.data_parallel or self.tp > 1 or self.pp > 1
                                   or self.cp > 1)

    @property
    def zero(self) -> int:
        """The ZeRO level in force: ``zero_level`` under data parallelism, else 0."""
        return self.zero_level if self.data_parallel else 0

    @property
    def sharded_update(self) -> bool:
        """ZeRO's distribution pass emits the update (optimizer state sharded over dp)."""
        return self.zero > 0

    @property
    def params_sharded(self) -> bool:
        """ZeRO-3: each rank holds a flat shard of every parameter between steps."""
        return self.zero == 3

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def embeddings_sharded(self) -> bool:
        """Tables sharded over several data-parallel ranks (passes/embedding_parallel.py)."""
        return self.embedding_parallel != "none" and self.data_parallel and self.grad_world > 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (pp x stages per rank)."""
        return self.pp * self.stages_per_rank

    def validate(self, model: Any = None, optimizer: Any = None) -> None:
        """Every refusal of a combination (``REFUSALS``), with ``model`` (a
        ``raf_dist.model.Model``) and ``optimizer`` for the rows that depend on them; raises
        the first that applies. Before any collective: every rank decides the same from the
        same values."""
        check(Case(self, None, model, optimizer))

    def __repr__(self) -> str:
        axes = ", ".join(f"{a} {self.coordinate(a)}/{self.size(a)}" for a in AXES
                         if a != "cp" or self.cp > 1)
        return f"ParallelLayout(rank {self.rank}/{self.world}: {axes})"


def _axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; the axes are "
                         f"{', '.join(map(repr, AXES))}")
    return axis
