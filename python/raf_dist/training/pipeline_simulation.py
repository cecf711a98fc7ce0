"""Running a pipeline schedule without running a model: ``simulate`` plays the per-rank
programs of training/pipeline_schedule.py (``rank_actions``) as an event simulation
(asynchronous tagged point-to-point: receives pre-posted, sends never block) and returns a
timeline, checking the schedule for deadlock on the way; ``bubble_fraction``,
``peak_in_flight`` and ``draw`` read the results, ``ideal_bubble`` is the textbook figure to
compare with.
"""
import os
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

from .pipeline_schedule import (COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, Action, check_int,
                                matching_recv)

#: one computed action: (rank, kind, stage, microbatch, start, end)
Event = Tuple[int, str, int, int, float, float]


class DeadlockError(RuntimeError):
    """``simulate`` reached a state where no rank can progress but some have actions left."""


def simulate(actions: Sequence[Sequence[Action]], forward_cost: float = 1.0,
             backward_cost: float = 2.0, comm_cost: float = 0.0) -> List[Event]:
    """Event simulation of per-rank programs (e.g. ``rank_actions`` output).

    Each rank executes its list in order. F takes ``forward_cost``, B ``backward_cost``.
    Communication is asynchronous tagged point-to-point: a SEND is instantaneous for the
    sender and never blocks; a RECV (pre-posted) blocks the rank until the matching SEND was
    issued, plus ``comm_cost``. UPDATE takes no time. A value between stages on the same rank
    is handed over locally once the producing action has finished.

    Returns the timeline: ``(rank, kind, stage, microbatch, start, end)`` for every F and B,
    sorted by start time then rank. Raises DeadlockError, listing each blocked rank's next
    action, when no rank can progress while some have actions left; ValueError when an F/B
    needs a value from another rank without a RECV for it earlier in its list.
    """
    P = len(actions)
    clock = [0.0] * P
    pos = [0] * P
    done: Dict[Tuple[str, int, int], float] = {}  # ("F"|"B", stage, mb) -> end time
    # (recv rank, RECV action) -> time the matching SEND was issued
    issued: Dict[Tuple[int, Action], float] = {}
    # (rank, "F"|"B", stage, mb) of values that arrived by RECV
    received: Set[Tuple[int, str, int, int]] = set()
    timeline: List[Event] = []
    S = max((a.stage for seq in actions for a in seq), default=-1) + 1

    def ready(rank: int, a: Action) -> Optional[float]:
        """Earliest start of ``a`` on ``rank`` from its inputs, or None when not yet ready."""
        t = clock[rank]
        deps: List[Tuple[str, int]] = []
        if a.kind == "F":
            if a.stage > 0:
                deps.append(("F", a.stage - 1))
        elif a.kind == "B":
            own = ("F", a.stage, a.microbatch)
            if own not in done:
                return None
            t = max(t, done[own])
            if a.stage < S - 1:
                deps.append(("B", a.stage + 1))
        for kind, s in deps:
            if s % P == rank:  # local hand-over
                key = (kind, s, a.microbatch)
                if key not in done:
                    return None
                t = max(t, done[key])
            elif (rank, kind, s, a.microbatch) not in received:
                raise ValueError(
                    f"rank {rank} runs {a} but never received {kind}{s}.{a.microbatch} from "
                    f"rank {s % P}: no RECV before it (use add_communication / rank_actions)"
                )
        return t

    remaining = sum(len(seq) for seq in actions)
    while remaining:
        progressed = False
        for rank in range(P):
            seq = actions[rank]
            while pos[rank] < len(seq):
                a = seq[pos[rank]]
                if a.kind in COMPUTE_KINDS:
                    start = ready(rank, a)
                    if start is None:
                        break
                    end = start + (forward_cost if a.kind == "F" else backward_cost)
                    done[(a.kind, a.stage, a.microbatch)] = end
                    clock[rank] = end
                    timeline.append((rank, a.kind, a.stage, a.microbatch, start, end))
                elif a.kind in SEND_KINDS:
                    issued[matching_recv(a, rank)] = clock[rank]
                elif a.kind in RECV_KINDS:
                    t = issued.get((rank, a))
                    if t is None:
                        break
                    clock[rank] = max(clock[rank], t + comm_cost)
                    # RECV_F(s) brings F(s-1)'s activation; RECV_B(s) brings B(s+1)'s gradient.
                    if a.kind == "RECV_F":
                        received.add((rank, "F", a.stage - 1, a.microbatch))
                    else:
                        received.add((rank, "B", a.stage + 1, a.microbatch))
                pos[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = [
                f"rank {r} blocked at {actions[r][pos[r]]} (action {pos[r]})"
                for r in range(P)
                if pos[r] < len(actions[r])
            ]
            raise DeadlockError("pipeline deadlock: " + "; ".join(blocked))
    timeline.sort(key=lambda e: (e[4], e[0]))
    return timeline


def bubble_fraction(timeline: Sequence[Event]) -> float:
    """Idle share of the pipeline: ``1 - busy / (num_ranks * makespan)``, with ``num_ranks``
    the highest rank in the timeline plus one and ``makespan`` from the earliest start to the
    latest end."""
    if not timeline:
        raise ValueError("empty timeline")
    num_ranks = max(e[0] for e in timeline) + 1
    makespan = max(e[5] for e in timeline) - min(e[4] for e in timeline)
    if makespan <= 0:
        return 0.0
    busy = sum(e[5] - e[4] for e in timeline)
    return 1.0 - busy / (num_ranks * makespan)


def ideal_bubble(pp_size: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """Textbook bubble fraction ``(P-1) / (M*v + P-1)``: GPipe and 1F1B (v = 1) give
    ``(P-1)/(M+P-1)``; interleaving with ``v`` chunks per rank divides the bubble time by v."""
    check_int("pp_size", pp_size, 1)
    check_int("num_microbatches", num_microbatches, 1)
    check_int("stages_per_rank", stages_per_rank, 1)
    return (pp_size - 1) / (num_microbatches * stages_per_rank + pp_size - 1)


def peak_in_flight(actions: Sequence[Sequence[Action]], num_stages: int) -> Dict[int, int]:
    """For each stage, the largest number of microbatches whose F has run and whose B has not
    yet run, walking the list of the stage's rank in order (activation memory held)."""
    check_int("num_stages", num_stages, 1)
    P = len(actions)
    peaks: Dict[int, int] = {}
    for s in range(num_stages):
        live = peak = 0
        for a in actions[s % P]:
            if a.stage != s:
                continue
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == "B":
                live -= 1
        peaks[s] = peak
    return peaks


def draw(timeline: Sequence[Event], path: Union[str, "os.PathLike[str]"], title: str = "") -> str:
    """Draw ``timeline`` as a PNG at ``path``: one row per pp rank (rank 0 on top), time on the
    x axis, F blocks in one colour and B in another, each labelled ``stage.microbatch``; idle
    time (the bubbles) is left white. The title carries the bubble fraction. Returns
    ``str(path)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timeline:
        raise ValueError("empty timeline")
    num_ranks = max(e[0] for e in timeline) + 1
    makespan = max(e[5] for e in timeline)
    colours = {"F": "#6fa8dc", "B": "#f6b26b"}
    width = min(max(6.0, makespan * 0.25), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * num_ranks + 1.2))
    try:
        for rank, kind, stage, mb, start, end in timeline:
            ax.barh(
                rank, end - start, left=start, height=0.8, color=colours[kind],
                edgecolor="black", linewidth=0.4,
            )
            ax.text(
                (start + end) / 2, rank, f"{stage}.{mb}", ha="center", va="center", fontsize=6
            )
        ax.set_facecolor("white")
        ax.set_xlim(0, makespan)
        ax.set_ylim(num_ranks - 0.5, -0.5)  # rank 0 on top
        ax.set_yticks(range(num_ranks))
        ax.set_yticklabels([f"rank {r}" for r in range(num_ranks)])
        ax.set_xlabel("time")
        bubble = bubble_fraction(timeline)
        head = f"{title} — " if title else ""
        ax.set_title(f"{head}bubble {bubble:.1%}")
        ax.legend(
            handles=[Patch(color=colours["F"], label="F"), Patch(color=colours["B"], label="B")],
            loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
        )
        fig.tight_layout()
        fig.savefig(str(path), format="png", dpi=100)
    finally:
        plt.close(fig)
    return str(path)
