"""``activation_memory_budget_mb`` under pipelining: recomputation chosen per stage.

A pipeline stage keeps the values its backward needs for every microbatch it has run forward
and not yet backward; under 1F1B stage s keeps up to S - s of them, so the first stages pay
for recomputation's absence several times over and the last stage once (Megatron-LM and
torchtitan recompute per stage for the same reason). The activation memory of a rank is
modelled as

    max over the rank's schedule of  sum over its stages s of  live_s(t) * saved_s
    + the largest planned temporaries of its stages' compiled functions

where ``live_s(t)`` counts the microbatches stage s holds after each of the rank's forwards
(its action list, walked once: ``saved_timeline``), ``saved_s`` is the bytes one microbatch
keeps (the forward's saved outputs; under "full" the stage input alone) and the temporaries
are the compiled module's planned peak (compiler/build.py's memory plan). The runtime's
counters (``ScheduleRun.peak_saved_bytes``) measure the first term; tests compare them.

``choose`` starts every stage without recomputation and, while the modelled peak exceeds the
budget, moves one stage one step along none -> "selective" -> "full": the stage whose step
lowers the peak most (ties: the earlier stage, which holds more microbatches). A budget that
all-"full" cannot meet is a ValueError naming the smallest peak it reached. Each rank chooses
for its own stages; the dp ranks of one pp rank hold the same stages and choose alike, and the
choice changes no message between stages (the schedule and the boundaries are the same).
"""
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

import tvm

from ..distributed.communicator import raised_on_every_rank

LEVELS = (False, "selective", "full")


def saved_timeline(actions: Iterable, stages: Sequence[int]) -> List[Dict[int, int]]:
    """{stage: microbatches held} after each forward of ``actions`` (a rank's action list,
    training/pipeline_schedule.py) for the rank's ``stages``."""
    live = {s: 0 for s in stages}
    points = []
    for a in actions:
        if a.kind == "F" and a.stage in live:
            live[a.stage] += 1
            points.append(dict(live))
        elif a.kind == "B" and a.stage in live:
            live[a.stage] -= 1
    return points or [dict(live)]


def modelled_peak(timeline: Sequence[Mapping[int, int]], saved: Mapping[int, int],
                  temps: Mapping[int, int]) -> int:
    """The model of the module docstring: the saved values' peak plus the largest stage's
    planned temporaries (bytes)."""
    held = max(sum(n * saved[s] for s, n in live.items()) for live in timeline)
    return held + max(temps.values(), default=0)


def choose(stages: Sequence[int], timeline: Sequence[Mapping[int, int]],
           measure: Callable[[int, object], Tuple[int, int]], budget_bytes: int
           ) -> Tuple[Dict[int, object], int]:
    """({stage: False | "selective" | "full"}, modelled peak): the least recomputation, per
    stage, whose modelled peak fits ``budget_bytes``. ``measure(stage, level)`` gives that
    stage's (saved bytes per microbatch, planned temporaries) at ``level``."""
    levels = {s: 0 for s in stages}
    seen: Dict[Tuple[Tuple[int, int], ...], int] = {}

    def peak(lv):
        key = tuple(sorted(lv.items()))
        if key not in seen:
            got = {s: measure(s, LEVELS[i]) for s, i in lv.items()}
            seen[key] = modelled_peak(timeline, {s: g[0] for s, g in got.items()},
                                      {s: g[1] for s, g in got.items()})
        return seen[key]

    current = peak(levels)
    while current > budget_bytes:
        steps = [(peak({**levels, s: levels[s] + 1}), s) for s in stages
                 if levels[s] + 1 < len(LEVELS)]
        if not steps:
            raise ValueError(
                f"activation_memory_budget_mb={budget_bytes / 2**20:g}: this pipeline rank's "
                f"stages {list(stages)} cannot fit; the smallest modelled activation memory "
                f"is {min(seen.values()) / 2**20:.3g} MB (saved values of the microbatches in "
                "flight plus the stages' planned temporaries; every stage recomputing "
                f"\"full\"); none {seen[tuple(sorted((s, 0) for s in stages))] / 2**20:.3g} "
                "MB. Raise the budget, use more microbatches of fewer rows, or more stages")
        current, stage = min(steps)
        levels[stage] += 1
    return {s: LEVELS[i] for s, i in levels.items()}, current


def saved_bytes(functions, level) -> int:
    """Bytes one microbatch of a stage keeps (``functions``: its training/pipeline.py
    StageFunctions compiled at ``level``): the forward's saved outputs, or under "full" what
    the schedule keeps instead (the stage's data inputs and, on the last stage, the
    target)."""
    if level == "full":
        specs = list(functions.input_specs)
        if functions.last and functions.target_spec is not None:
            specs.append(functions.target_spec)
        return sum(_bytes(shape, dtype) for shape, dtype in specs)
    fields = functions.mod["forward"].ret_ty.fields
    return sum(_bytes(f.shape, f.dtype) for f in fields[1:1 + functions.num_saved])


def _bytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * ((tvm.DataType(str(dtype)).bits + 7) // 8)


def choose_on_every_rank(comm, stages, timeline, measure, budget_bytes):
    """``choose`` on every rank of ``comm``; a rank whose stages cannot fit makes every rank
    raise its error (one allgather: the other ranks would otherwise wait for it in their
    first collective)."""
    try:
        chosen, error = choose(stages, timeline, measure, budget_bytes)[0], None
    except ValueError as exc:
        chosen, error = None, str(exc)
    errors = [(r, e) for r, e in enumerate(comm.mpi_comm.allgather(error)) if e is not None]
    if errors:
        rank, text = errors[0]
        raise raised_on_every_rank(ValueError(f"rank {rank}: {text}"))
    return chosen
