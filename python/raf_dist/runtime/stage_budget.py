"""``activation_memory_budget_mb`` under pipelining: recomputation chosen per stage.

A pipeline stage keeps the values its backward needs for every microbatch it has run forward
and not yet backward; under 1F1B stage s keeps up to S - s of them, so the first stages pay
for recomputation's absence several times over and the last stage once (Megatron-LM and
torchtitan recompute per stage for the same reason). The activation memory of a rank is
modelled as

    max( max over the rank's schedule of ( sum over its stages s of live_s(t) * saved_s
                                           + boundary(t) )
         + the largest planned temporaries of its stages' compiled functions,
         the update's planned temporaries )

where ``live_s(t)`` counts the microbatches stage s holds after each of the rank's actions
(its action list, walked once: ``held_timeline``), ``saved_s`` is the bytes one microbatch
keeps (the forward's saved outputs; under "full" the stage input alone), ``boundary(t)`` the
bytes of the stage-boundary messages held then (runtime/schedule_run.py posts every receive
of the step first and keeps each sent message until the step's sends are waited, at its end;
between a stage and the next action the activation or gradient waits in a handoff or for its
SEND), the temporaries are the compiled module's planned peak (compiler/build.py's memory
plan), and the update, which runs after the schedule has let every saved value go, plans its
own. The runtime's counters (``ScheduleRun.peak_saved_bytes``, ``peak_held_bytes``) measure
the first term; tests compare them.

``choose`` starts every stage without recomputation and, while the modelled peak exceeds the
budget, moves one stage one step along none -> "selective" -> "full": the stage whose step
lowers the peak most (ties: the earlier stage, which holds more microbatches). A budget that
all-"full" cannot meet is a ValueError naming the smallest peak it reached. Each rank chooses
for its own stages; the dp ranks of one pp rank hold the same stages and choose alike, and the
choice changes no message between stages (the schedule and the boundaries are the same).
"""
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, TypeVar

import tvm

from ..distributed.communicator import raised_on_every_rank

LEVELS = (False, "selective", "full")
_Bytes = TypeVar("_Bytes", int, float)


#: one point of a rank's schedule: ({stage: microbatches whose saved values it holds},
#: bytes of boundary messages held)
Point = Tuple[Dict[int, int], int]


class Messages:
    """The bytes of a rank's stage-boundary messages. ``specs[b]``: boundary b's message
    (stage b's output, stage b + 1's input) as (shape, dtype), for the S - 1 boundaries of
    S stages; ``input_specs[s]``: stage s's input, whose gradient its backward returns in
    that dtype (float32 where the message is 16-bit: narrowed when sent)."""

    def __init__(self, specs: Sequence[Tuple[Sequence[int], str]],
                 input_specs: Mapping[int, Tuple[Sequence[int], str]]) -> None:
        self.specs = list(specs)
        self.last = len(self.specs)  # the last stage's index
        self.input_grads = {s: _bytes(*spec) for s, spec in input_specs.items()}

    def message(self, boundary: int) -> int:
        return _bytes(*self.specs[boundary])


def held_timeline(actions: Iterable, stages: Sequence[int],
                  messages: Optional[Messages] = None) -> List[Point]:
    """What the rank holds after each of ``actions`` (its action list,
    training/pipeline_schedule.py) for its ``stages``, the first point before any action (the
    step's receives posted): runtime/schedule_run.py's bookkeeping, walked without running
    anything. Without ``messages`` the boundary bytes are 0."""
    actions = list(actions)
    mine = set(stages)
    live = {s: 0 for s in stages}
    if messages is None:
        return [(dict(live), 0)] + [(_count(live, a), 0) for a in actions]
    last = messages.last
    # every receive of the step is posted first (a buffer of the message's bytes); a
    # received buffer becomes the handoff its stage reads, of the same bytes
    held = sum(messages.message(a.stage - 1 if a.kind == "RECV_F" else a.stage)
               for a in actions if a.kind in ("RECV_F", "RECV_B"))
    points = [(dict(live), held)]
    for a in actions:
        s = a.stage
        if a.kind == "F":
            if s > 0:  # the activation it read (a message, or stage s - 1's output here)
                held -= messages.message(s - 1)
            if s < last:  # its output, handed to stage s + 1 here or waiting for its SEND
                held += messages.message(s)
        elif a.kind == "B":
            if s < last:  # the gradient it read: a message, or stage s + 1's float32 one here
                held -= messages.input_grads[s + 1] if s + 1 in mine else messages.message(s)
            if s > 0:  # its input's gradient (float32), for stage s - 1
                held += messages.input_grads[s]
        elif a.kind == "SEND_B":  # narrowed to the message, kept until the step's end
            held += messages.message(s - 1) - messages.input_grads[s]
        # (SEND_F: the activation's host copy replaces it, kept until the step's end;
        # RECV_*: the posted buffer's bytes become the handoff's)
        points.append((_count(live, a), held))
    return points


def _count(live: Dict[int, int], action) -> Dict[int, int]:
    """``live`` after ``action`` (updated in place; a copy returned)."""
    if action.kind == "F" and action.stage in live:
        live[action.stage] += 1
    elif action.kind == "B" and action.stage in live:
        live[action.stage] -= 1
    return dict(live)


def modelled_peak(timeline: Sequence[Point], saved: Mapping[int, int],
                  temps: Mapping[int, int], update_temps: int = 0) -> int:
    """The model of the module docstring (bytes): the saved values and boundary messages at
    their peak plus the largest stage's planned temporaries, or the update's temporaries."""
    held = max(sum(n * saved[s] for s, n in live.items()) + boundary
               for live, boundary in timeline)
    return max(held + max(temps.values(), default=0), update_temps)


def choose(stages: Sequence[int], timeline: Sequence[Point],
           measure: Callable[[int, object], Tuple[int, int]], budget_bytes: int,
           update_temps: int = 0) -> Tuple[Dict[int, object], int]:
    """({stage: False | "selective" | "full"}, modelled peak): the least recomputation, per
    stage, whose modelled peak fits ``budget_bytes``. ``measure(stage, level)`` gives that
    stage's (saved bytes per microbatch, planned temporaries) at ``level``."""
    seen: Dict[Tuple[Tuple[int, int], ...], int] = {}

    def peak(lv):
        key = tuple(sorted(lv.items()))
        if key not in seen:
            got = {s: measure(s, LEVELS[i]) for s, i in lv.items()}
            seen[key] = modelled_peak(timeline, {s: g[0] for s, g in got.items()},
                                      {s: g[1] for s, g in got.items()}, update_temps)
        return seen[key]

    chosen, current = raise_levels(stages, peak, budget_bytes)
    if chosen is None:
        raise ValueError(
            f"activation_memory_budget_mb={budget_bytes / 2**20:g}: this pipeline rank's "
            f"stages {list(stages)} cannot fit; the smallest modelled activation memory "
            f"is {min(seen.values()) / 2**20:.3g} MB (saved values of the microbatches in "
            "flight, the boundary messages held and the stages' planned temporaries, "
            "or the update's; every stage recomputing "
            f"\"full\"); none {seen[tuple(sorted((s, 0) for s in stages))] / 2**20:.3g} "
            "MB. Raise the budget, use more microbatches of fewer rows, or more stages")
    return {s: LEVELS[i] for s, i in chosen.items()}, current


def raise_levels(stages: Sequence[int], peak: Callable[[Dict[int, int]], _Bytes],
                 budget_bytes: float) -> Tuple[Optional[Dict[int, int]], _Bytes]:
    """The search ``choose`` makes (and tools/plan.py's on its own memory model): every stage
    at ``LEVELS[0]``, then, while ``peak(levels)`` exceeds ``budget_bytes``, one stage one
    level up, the raise with the lowest peak first (ties: the earlier stage). Returns
    ({stage: index into LEVELS}, its peak), or (None, the last peak) when every stage is at
    the top and the peak still exceeds the budget."""
    levels = {s: 0 for s in stages}
    current = peak(levels)
    while current > budget_bytes:
        steps = [(peak({**levels, s: levels[s] + 1}), s) for s in stages
                 if levels[s] + 1 < len(LEVELS)]
        if not steps:
            return None, current
        current, stage = min(steps)
        levels[stage] += 1
    return levels, current


def saved_bytes(functions, level) -> int:
    """Bytes one microbatch of a stage keeps (``functions``: its training/pipeline_step.py
    StageFunctions compiled at ``level``): the forward's saved outputs, or under "full" what
    the schedule keeps instead (the stage's data inputs and, on the last stage, the
    target)."""
    if level == "full":
        specs = list(functions.input_specs)
        if functions.last and functions.target_spec is not None:
            specs.append(functions.target_spec)
        return sum(_bytes(shape, dtype) for shape, dtype in specs)
    fields = functions.mod["forward"].ret_ty.fields
    return sum(_type_bytes(f) for f in fields[1:1 + functions.num_saved])


def _type_bytes(ty: Any) -> int:
    """Bytes of a saved value's type: a tensor, or a tuple of them (the attention op's output
    and log-sum-exp, ir/attention.py)."""
    if hasattr(ty, "fields"):
        return sum(_type_bytes(f) for f in ty.fields)
    return _bytes(ty.shape, ty.dtype)


def _bytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * ((tvm.DataType(str(dtype)).bits + 7) // 8)


def choose_on_every_rank(comm, stages, timeline, measure, budget_bytes, update_temps=0):
    """``choose`` on every rank of ``comm``; a rank whose stages cannot fit makes every rank
    raise its error (one allgather: the other ranks would otherwise wait for it in their
    first collective)."""
    try:
        chosen, error = choose(stages, timeline, measure, budget_bytes, update_temps)[0], None
    except ValueError as exc:
        chosen, error = None, str(exc)
    errors = [(r, e) for r, e in enumerate(comm.mpi_comm.allgather(error)) if e is not None]
    if errors:
        rank, text = errors[0]
        raise raised_on_every_rank(ValueError(f"rank {rank}: {text}"))
    return chosen


_Point = TypeVar("_Point")


def first_fitting(ranges: Sequence[Sequence[_Point]],
                  fits: Callable[[_Point], bool]) -> Optional[_Point]:
    """The SPMD step's search (runtime/spmd_build.py): ``ranges`` are consecutive stretches
    of one ladder of recomputation points (each range's first point known not to fit),
    within which fewer recomputed values plan to more memory; a range is bisected only once
    its top end fits (the ranges' peaks are not ordered among each other), so about log2 of
    the points' count of ``fits`` calls. Returns the first fitting point found, or None.

    Why not ``raise_levels``: the SPMD step is one compiled function whose recomputation is
    one point of a long ordered ladder (a value or a block at a time, measured by planning the
    whole step), so it is bisected; a pipeline rank holds several stages, each with three
    levels and a peak modelled over the schedule's timeline, so the search there is a greedy
    raise over a vector of levels. Both searches live here, beside the pipeline's model."""
    for points in ranges:
        if not fits(points[-1]):
            continue
        low, high = 0, len(points) - 1  # points[low] does not fit, points[high] does
        while high - low > 1:
            middle = (low + high) // 2
            if fits(points[middle]):
                high = middle
            else:
                low = middle
        return points[high]
    return None
