"""Pipeline-parallel schedules: which forward/backward each pipeline rank runs, in what order,
with the point-to-point communication between ranks, plus an event simulator to check a
schedule for deadlock and measure its bubble.

Vocabulary. ``P`` pipeline ranks (pp ranks ``0 .. P-1``), ``S = P * v`` stages (``v`` stages per
rank; ``v > 1`` only for the interleaved schedule), ``M`` microbatches per step. Stage ``s``
lives on pp rank ``s % P`` (the Megatron / torchtitan "loop" placement: rank ``r`` holds
stages ``r, r + P, r + 2P, ...``, its "model chunks" ``0 .. v-1``). Every stage runs ``F``
(forward of one microbatch) and ``B`` (backward of one microbatch):

* ``F(s, m)`` needs the activation of ``F(s-1, m)`` (not for ``s = 0``);
* ``B(s, m)`` needs ``F(s, m)`` and the gradient of ``B(s+1, m)`` (the last stage ``S-1`` needs
  only its own ``F(S-1, m)``: the loss is computed there).

Schedules (``SCHEDULES``):

* ``"gpipe"``: every forward, then every backward. Peak activation memory: ``M`` microbatches
  in flight on every stage.
* ``"1f1b"``: Megatron's non-interleaved one-forward-one-backward schedule. Rank ``r`` runs
  ``min(P - r - 1, M)`` warmup forwards, then alternates F, B, then drains the backwards. Same
  bubble as GPipe, but at most ``min(P - r, M)`` microbatches in flight on rank ``r``.
* ``"interleaved_1f1b"``: Megatron's interleaved schedule
  (``megatron/core/pipeline_parallel/schedules.py``,
  ``forward_backward_pipelining_with_interleaving``), ``v >= 2`` chunks per rank, ``M`` a
  multiple of ``P``. Divides the bubble by about ``v`` at the price of ``v`` times more
  point-to-point messages.

Pipeline: ``compute_actions`` (per-rank F/B order) -> ``add_communication`` (SEND/RECV around
them, one UPDATE at the end) = ``rank_actions``; ``check_actions`` validates a list;
``simulate`` runs it as an event simulation (asynchronous tagged point-to-point: receives
pre-posted, sends never block) and returns a timeline; ``bubble_fraction``, ``peak_in_flight``
and ``draw`` read the results.
"""
import dataclasses

from ..layout.mesh import stage_rank  # noqa: F401  (placement: where each stage runs)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UPDATE")
_COMPUTE = ("F", "B")
_SENDS = ("SEND_F", "SEND_B")
_RECVS = ("RECV_F", "RECV_B")


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of a pipeline rank's program.

    ``kind``: ``"F"``/``"B"`` (compute forward/backward), ``"SEND_F"``/``"RECV_F"`` (an
    activation going to the next stage), ``"SEND_B"``/``"RECV_B"`` (a gradient going to the
    previous stage), ``"UPDATE"`` (the optimizer step, once at the end).
    ``stage``: the stage computing (F/B), sending (SEND_*) or receiving (RECV_*); -1 for UPDATE.
    So ``SEND_F(s)`` pairs with ``RECV_F(s+1)`` and ``SEND_B(s)`` with ``RECV_B(s-1)``.
    ``microbatch``: -1 for UPDATE. ``peer``: pp rank at the other end of a SEND/RECV, else -1.
    """

    kind: str
    stage: int
    microbatch: int
    peer: int = -1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")

    def __str__(self):
        if self.kind == "UPDATE":
            return "UPDATE"
        base = f"{self.kind}{self.stage}.{self.microbatch}"
        if self.kind in _SENDS:
            return f"{base}->r{self.peer}"
        if self.kind in _RECVS:
            return f"{base}<-r{self.peer}"
        return base


class DeadlockError(RuntimeError):
    """``simulate`` reached a state where no rank can progress but some have actions left."""


# --------------------------------------------------------------------------------------------
# Validation helpers


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_schedule(schedule):
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")


def num_stages(schedule, pp_size, stages_per_rank=1):
    """Total number of stages ``pp_size * stages_per_rank``.

    ``stages_per_rank`` must be 1 for ``"gpipe"`` and ``"1f1b"`` and >= 2 for
    ``"interleaved_1f1b"``; ValueError otherwise.
    """
    _check_schedule(schedule)
    _check_int("pp_size", pp_size, 1)
    _check_int("stages_per_rank", stages_per_rank, 1)
    if schedule == "interleaved_1f1b":
        if stages_per_rank < 2:
            raise ValueError(
                "interleaved_1f1b needs >= 2 stages per rank (stages_per_rank=v >= 2); "
                f"got {stages_per_rank}. Use schedule '1f1b' for one stage per rank."
            )
    elif stages_per_rank != 1:
        raise ValueError(
            f"schedule {schedule!r} supports exactly 1 stage per rank, got stages_per_rank="
            f"{stages_per_rank}; use 'interleaved_1f1b' for several stages per rank"
        )
    return pp_size * stages_per_rank


# --------------------------------------------------------------------------------------------
# Schedules


def _gpipe(rank, pp_size, num_microbatches):
    fwd = [Action("F", rank, m) for m in range(num_microbatches)]
    bwd = [Action("B", rank, m) for m in range(num_microbatches)]
    return fwd + bwd


def _one_f_one_b(rank, pp_size, num_microbatches):
    warmup = min(pp_size - rank - 1, num_microbatches)
    remaining = num_microbatches - warmup
    out = [Action("F", rank, m) for m in range(warmup)]
    for i in range(remaining):
        out.append(Action("F", rank, warmup + i))
        out.append(Action("B", rank, i))
    out.extend(Action("B", rank, m) for m in range(remaining, num_microbatches))
    return out


def _interleaved(rank, pp_size, num_microbatches, v):
    """Megatron's ``forward_backward_pipelining_with_interleaving`` order for one rank."""
    P = pp_size
    total = num_microbatches * v

    def microbatch(k):
        return (k // (P * v)) * P + k % P

    def fwd(k):
        chunk = (k // P) % v
        return Action("F", chunk * P + rank, microbatch(k))

    def bwd(k):
        chunk = v - 1 - (k // P) % v
        return Action("B", chunk * P + rank, microbatch(k))

    warmup = min((P - rank - 1) * 2 + (v - 1) * P, total)
    remaining = total - warmup
    out = [fwd(k) for k in range(warmup)]
    for k in range(remaining):
        out.append(fwd(warmup + k))
        out.append(bwd(k))
    out.extend(bwd(k) for k in range(remaining, total))
    return out


def compute_actions(schedule, pp_size, num_microbatches, stages_per_rank=1):
    """Per pp rank, its F/B actions in execution order (no communication; see
    ``add_communication``).

    * ``"gpipe"``: F of the rank's stage for m = 0..M-1, then B for m = 0..M-1.
    * ``"1f1b"``: ``warmup = min(P - r - 1, M)`` forwards, then F, B alternately for the
      remaining ``M - warmup`` forwards, then the remaining backwards.
    * ``"interleaved_1f1b"``: ``v = stages_per_rank >= 2``, ``M`` a multiple of ``P``. Virtual
      microbatch ``k`` in ``0 .. M*v - 1``: forward chunk ``(k // P) % v``, backward chunk
      ``v - 1 - (k // P) % v``, microbatch ``(k // (P*v)) * P + k % P``; chunk ``c`` on rank
      ``r`` is stage ``c*P + r``. ``warmup = min((P - r - 1) * 2 + (v - 1) * P, M*v)``
      forwards, then 1F1B steady state, then the cooldown backwards.
    """
    num_stages(schedule, pp_size, stages_per_rank)  # validates schedule, pp_size and v
    _check_int("num_microbatches", num_microbatches, 1)
    if schedule == "gpipe":
        return [_gpipe(r, pp_size, num_microbatches) for r in range(pp_size)]
    if schedule == "1f1b":
        return [_one_f_one_b(r, pp_size, num_microbatches) for r in range(pp_size)]
    if num_microbatches % pp_size != 0:
        lower = (num_microbatches // pp_size) * pp_size
        upper = lower + pp_size
        hint = f"{upper}" if lower == 0 else f"{lower} or {upper}"
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches to be a multiple of pp_size={pp_size}, "
            f"got {num_microbatches}; use num_microbatches={hint} (or schedule '1f1b')"
        )
    return [_interleaved(r, pp_size, num_microbatches, stages_per_rank) for r in range(pp_size)]


def add_communication(compute, pp_size, num_microbatches, num_stages):
    """Insert point-to-point communication around the F/B actions of ``compute`` (one list per
    pp rank) and end every rank's list with one UPDATE.

    Around ``F(s, m)``: a ``RECV_F(s, m, peer=rank(s-1))`` just before it when ``s > 0`` and
    stage ``s-1`` is on another rank; a ``SEND_F(s, m, peer=rank(s+1))`` just after it when
    ``s < S-1`` and stage ``s+1`` is on another rank. Around ``B(s, m)``: ``RECV_B(s, m,
    peer=rank(s+1))`` before it when ``s < S-1`` and ``s+1`` is remote; ``SEND_B(s, m,
    peer=rank(s-1))`` after it when ``s > 0`` and ``s-1`` is remote. A neighbour on the same
    rank gets the value handed over locally (no message).
    """
    _check_int("pp_size", pp_size, 1)
    _check_int("num_microbatches", num_microbatches, 1)
    _check_int("num_stages", num_stages, 1)
    if len(compute) != pp_size:
        raise ValueError(f"compute has {len(compute)} rank lists, expected pp_size={pp_size}")
    S = num_stages
    out = []
    for rank, actions in enumerate(compute):
        seq = []
        for a in actions:
            s, m = a.stage, a.microbatch
            if a.kind == "F":
                if s > 0 and stage_rank(s - 1, pp_size) != rank:
                    seq.append(Action("RECV_F", s, m, stage_rank(s - 1, pp_size)))
                seq.append(a)
                if s < S - 1 and stage_rank(s + 1, pp_size) != rank:
                    seq.append(Action("SEND_F", s, m, stage_rank(s + 1, pp_size)))
            elif a.kind == "B":
                if s < S - 1 and stage_rank(s + 1, pp_size) != rank:
                    seq.append(Action("RECV_B", s, m, stage_rank(s + 1, pp_size)))
                seq.append(a)
                if s > 0 and stage_rank(s - 1, pp_size) != rank:
                    seq.append(Action("SEND_B", s, m, stage_rank(s - 1, pp_size)))
            else:
                raise ValueError(f"add_communication expects only F/B actions, got {a}")
        seq.append(Action("UPDATE", -1, -1))
        out.append(seq)
    return out


def rank_actions(schedule, pp_size, num_microbatches, stages_per_rank=1):
    """``compute_actions`` followed by ``add_communication``: each rank's full program."""
    compute = compute_actions(schedule, pp_size, num_microbatches, stages_per_rank)
    S = num_stages(schedule, pp_size, stages_per_rank)
    return add_communication(compute, pp_size, num_microbatches, S)


# --------------------------------------------------------------------------------------------
# Checking


def _recv_key_for_send(a, sender):
    """The (receiving rank, RECV action) that a SEND on ``sender`` must meet."""
    if a.kind == "SEND_F":
        return a.peer, Action("RECV_F", a.stage + 1, a.microbatch, sender)
    return a.peer, Action("RECV_B", a.stage - 1, a.microbatch, sender)


def check_actions(actions, num_stages, num_microbatches):
    """Validate per-rank action lists (``actions[r]`` is pp rank ``r``'s program).

    Checks: every action's stage and microbatch are in range and its stage lives on the rank
    running it; every (stage, microbatch) has exactly one F and one B, F before B; every
    SEND/RECV names the right peer (the rank of the neighbouring stage, another rank) and each
    SEND matches exactly one RECV (``SEND_F(s, m)`` on rank r <-> ``RECV_F(s+1, m, peer=r)`` on
    the peer, ``SEND_B(s, m)`` <-> ``RECV_B(s-1, m, peer=r)``) and vice versa; UPDATE at most
    once per rank, last. Lists without any communication (``compute_actions`` output) pass.
    Raises ValueError naming the first problem found.
    """
    _check_int("num_stages", num_stages, 1)
    _check_int("num_microbatches", num_microbatches, 1)
    P = len(actions)
    if P < 1:
        raise ValueError("actions must hold at least one rank's list")
    S, M = num_stages, num_microbatches
    if S % P != 0:
        raise ValueError(f"num_stages={S} is not a multiple of the {P} ranks in actions")
    seen = {}  # (kind, stage, mb) -> (rank, index)
    sends = {}  # (recv rank, RECV action) -> count
    recvs = {}  # (rank, RECV action) -> count
    for rank, seq in enumerate(actions):
        for i, a in enumerate(seq):
            where = f"rank {rank} action {i} ({a})"
            if a.kind == "UPDATE":
                if i != len(seq) - 1:
                    raise ValueError(f"{where}: UPDATE must be the last action of the rank")
                continue
            if not (0 <= a.stage < S):
                raise ValueError(f"{where}: stage {a.stage} out of range 0..{S - 1}")
            if not (0 <= a.microbatch < M):
                raise ValueError(f"{where}: microbatch {a.microbatch} out of range 0..{M - 1}")
            if a.stage % P != rank:
                raise ValueError(f"{where}: stage {a.stage} lives on rank {a.stage % P}")
            if a.kind in _COMPUTE:
                key = (a.kind, a.stage, a.microbatch)
                if key in seen:
                    raise ValueError(
                        f"{where}: duplicate {a}, already at rank {seen[key][0]} "
                        f"action {seen[key][1]}"
                    )
                if a.kind == "B" and ("F", a.stage, a.microbatch) not in seen:
                    raise ValueError(f"{where}: B{a.stage}.{a.microbatch} before its forward")
                seen[key] = (rank, i)
                continue
            # communication
            if a.kind in ("SEND_F", "RECV_B"):
                other = a.stage + 1
            else:  # SEND_B, RECV_F
                other = a.stage - 1
            if not (0 <= other < S):
                raise ValueError(f"{where}: stage {a.stage} has no neighbour stage {other}")
            if a.peer != other % P:
                raise ValueError(
                    f"{where}: peer r{a.peer} but neighbour stage {other} lives on "
                    f"rank {other % P}"
                )
            if a.peer == rank:
                raise ValueError(f"{where}: sends/receives to its own rank (hand over locally)")
            if a.kind in _SENDS:
                k = _recv_key_for_send(a, rank)
                sends[k] = sends.get(k, 0) + 1
            else:
                k = (rank, a)
                recvs[k] = recvs.get(k, 0) + 1
    for kind in _COMPUTE:
        for s in range(S):
            for m in range(M):
                if (kind, s, m) not in seen:
                    raise ValueError(
                        f"missing {kind}{s}.{m} (stage {s}, microbatch {m}) on rank {s % P}"
                    )
    for (rank, recv), n in sends.items():
        if n != 1:
            raise ValueError(f"{n} sends feed {recv} on rank {rank}; expected exactly one")
        got = recvs.get((rank, recv), 0)
        if got != 1:
            raise ValueError(
                f"a send from rank {recv.peer} expects {recv} on rank {rank}, which has {got} "
                "matching receives; expected exactly one"
            )
    for (rank, recv), n in recvs.items():
        if (rank, recv) not in sends:
            raise ValueError(f"rank {rank} runs {recv} but no matching send exists")


# --------------------------------------------------------------------------------------------
# Simulation


def simulate(actions, forward_cost=1.0, backward_cost=2.0, comm_cost=0.0):
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
    done = {}  # ("F"|"B", stage, mb) -> end time
    issued = {}  # (recv rank, RECV action) -> time the matching SEND was issued
    received = set()  # (rank, "F"|"B", stage, mb) of values that arrived by RECV
    timeline = []
    S = max((a.stage for seq in actions for a in seq), default=-1) + 1

    def ready(rank, a):
        """Earliest start of ``a`` on ``rank`` from its inputs, or None when not yet ready."""
        t = clock[rank]
        deps = []
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
                if a.kind in _COMPUTE:
                    start = ready(rank, a)
                    if start is None:
                        break
                    end = start + (forward_cost if a.kind == "F" else backward_cost)
                    done[(a.kind, a.stage, a.microbatch)] = end
                    clock[rank] = end
                    timeline.append((rank, a.kind, a.stage, a.microbatch, start, end))
                elif a.kind in _SENDS:
                    issued[_recv_key_for_send(a, rank)] = clock[rank]
                elif a.kind in _RECVS:
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


def bubble_fraction(timeline):
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


def ideal_bubble(pp_size, num_microbatches, stages_per_rank=1):
    """Textbook bubble fraction ``(P-1) / (M*v + P-1)``: GPipe and 1F1B (v = 1) give
    ``(P-1)/(M+P-1)``; interleaving with ``v`` chunks per rank divides the bubble time by v."""
    _check_int("pp_size", pp_size, 1)
    _check_int("num_microbatches", num_microbatches, 1)
    _check_int("stages_per_rank", stages_per_rank, 1)
    return (pp_size - 1) / (num_microbatches * stages_per_rank + pp_size - 1)


def peak_in_flight(actions, num_stages):
    """For each stage, the largest number of microbatches whose F has run and whose B has not
    yet run, walking the list of the stage's rank in order (activation memory held)."""
    _check_int("num_stages", num_stages, 1)
    P = len(actions)
    peaks = {}
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


def draw(timeline, path, title=""):
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
