"""Pipeline-parallel schedules: which forward/backward each pipeline rank runs, in what order,
with the point-to-point communication between ranks (training/pipeline_simulation.py runs a
schedule as an event simulation to check it for deadlock and measure its bubble).

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
pipeline_simulation.py's ``simulate`` runs it and returns a timeline.
"""
import dataclasses
from typing import Dict, List, Sequence, Tuple

from ..layout.parallel import stage_rank  # noqa: F401  (placement: where each stage runs)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UPDATE")
COMPUTE_KINDS = ("F", "B")
SEND_KINDS = ("SEND_F", "SEND_B")
RECV_KINDS = ("RECV_F", "RECV_B")


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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")

    def __str__(self) -> str:
        if self.kind == "UPDATE":
            return "UPDATE"
        base = f"{self.kind}{self.stage}.{self.microbatch}"
        if self.kind in SEND_KINDS:
            return f"{base}->r{self.peer}"
        if self.kind in RECV_KINDS:
            return f"{base}<-r{self.peer}"
        return base


# --------------------------------------------------------------------------------------------
# Validation helpers


def check_int(name: str, value: object, minimum: int) -> None:
    """Raise unless ``value`` (argument ``name``) is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")


def num_stages(schedule: str, pp_size: int, stages_per_rank: int = 1) -> int:
    """Total number of stages ``pp_size * stages_per_rank``.

    ``stages_per_rank`` must be 1 for ``"gpipe"`` and ``"1f1b"`` and >= 2 for
    ``"interleaved_1f1b"``; ValueError otherwise.
    """
    _check_schedule(schedule)
    check_int("pp_size", pp_size, 1)
    check_int("stages_per_rank", stages_per_rank, 1)
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


def _gpipe(rank: int, pp_size: int, num_microbatches: int) -> List[Action]:
    fwd = [Action("F", rank, m) for m in range(num_microbatches)]
    bwd = [Action("B", rank, m) for m in range(num_microbatches)]
    return fwd + bwd


def _one_f_one_b(rank: int, pp_size: int, num_microbatches: int) -> List[Action]:
    warmup = min(pp_size - rank - 1, num_microbatches)
    remaining = num_microbatches - warmup
    out = [Action("F", rank, m) for m in range(warmup)]
    for i in range(remaining):
        out.append(Action("F", rank, warmup + i))
        out.append(Action("B", rank, i))
    out.extend(Action("B", rank, m) for m in range(remaining, num_microbatches))
    return out


def _interleaved(rank: int, pp_size: int, num_microbatches: int, v: int) -> List[Action]:
    """Megatron's ``forward_backward_pipelining_with_interleaving`` order for one rank."""
    P = pp_size
    total = num_microbatches * v

    def microbatch(k: int) -> int:
        return (k // (P * v)) * P + k % P

    def fwd(k: int) -> Action:
        chunk = (k // P) % v
        return Action("F", chunk * P + rank, microbatch(k))

    def bwd(k: int) -> Action:
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


def compute_actions(schedule: str, pp_size: int, num_microbatches: int,
                    stages_per_rank: int = 1) -> List[List[Action]]:
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
    check_int("num_microbatches", num_microbatches, 1)
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


def add_communication(compute: Sequence[Sequence[Action]], pp_size: int,
                      num_microbatches: int, num_stages: int) -> List[List[Action]]:
    """Insert point-to-point communication around the F/B actions of ``compute`` (one list per
    pp rank) and end every rank's list with one UPDATE.

    Around ``F(s, m)``: a ``RECV_F(s, m, peer=rank(s-1))`` just before it when ``s > 0`` and
    stage ``s-1`` is on another rank; a ``SEND_F(s, m, peer=rank(s+1))`` just after it when
    ``s < S-1`` and stage ``s+1`` is on another rank. Around ``B(s, m)``: ``RECV_B(s, m,
    peer=rank(s+1))`` before it when ``s < S-1`` and ``s+1`` is remote; ``SEND_B(s, m,
    peer=rank(s-1))`` after it when ``s > 0`` and ``s-1`` is remote. A neighbour on the same
    rank gets the value handed over locally (no message).
    """
    check_int("pp_size", pp_size, 1)
    check_int("num_microbatches", num_microbatches, 1)
    check_int("num_stages", num_stages, 1)
    if len(compute) != pp_size:
        raise ValueError(f"compute has {len(compute)} rank lists, expected pp_size={pp_size}")
    S = num_stages
    out: List[List[Action]] = []
    for rank, actions in enumerate(compute):
        seq: List[Action] = []
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


def rank_actions(schedule: str, pp_size: int, num_microbatches: int,
                 stages_per_rank: int = 1) -> List[List[Action]]:
    """``compute_actions`` followed by ``add_communication``: each rank's full program."""
    compute = compute_actions(schedule, pp_size, num_microbatches, stages_per_rank)
    S = num_stages(schedule, pp_size, stages_per_rank)
    return add_communication(compute, pp_size, num_microbatches, S)


# --------------------------------------------------------------------------------------------
# Checking


def matching_recv(a: Action, sender: int) -> Tuple[int, Action]:
    """The (receiving rank, RECV action) that a SEND on ``sender`` must meet."""
    if a.kind == "SEND_F":
        return a.peer, Action("RECV_F", a.stage + 1, a.microbatch, sender)
    return a.peer, Action("RECV_B", a.stage - 1, a.microbatch, sender)


def check_actions(actions: Sequence[Sequence[Action]], num_stages: int,
                  num_microbatches: int) -> None:
    """Validate per-rank action lists (``actions[r]`` is pp rank ``r``'s program).

    Checks: every action's stage and microbatch are in range and its stage lives on the rank
    running it; every (stage, microbatch) has exactly one F and one B, F before B; every
    SEND/RECV names the right peer (the rank of the neighbouring stage, another rank) and each
    SEND matches exactly one RECV (``SEND_F(s, m)`` on rank r <-> ``RECV_F(s+1, m, peer=r)`` on
    the peer, ``SEND_B(s, m)`` <-> ``RECV_B(s-1, m, peer=r)``) and vice versa; UPDATE at most
    once per rank, last. Lists without any communication (``compute_actions`` output) pass.
    Raises ValueError naming the first problem found.
    """
    check_int("num_stages", num_stages, 1)
    check_int("num_microbatches", num_microbatches, 1)
    P = len(actions)
    if P < 1:
        raise ValueError("actions must hold at least one rank's list")
    S, M = num_stages, num_microbatches
    if S % P != 0:
        raise ValueError(f"num_stages={S} is not a multiple of the {P} ranks in actions")
    seen: Dict[Tuple[str, int, int], Tuple[int, int]] = {}  # (kind, stage, mb) -> (rank, index)
    sends: Dict[Tuple[int, Action], int] = {}  # (recv rank, RECV action) -> count
    recvs: Dict[Tuple[int, Action], int] = {}  # (rank, RECV action) -> count
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
            if a.kind in COMPUTE_KINDS:
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
            if a.kind in SEND_KINDS:
                k = matching_recv(a, rank)
                sends[k] = sends.get(k, 0) + 1
            else:
                k = (rank, a)
                recvs[k] = recvs.get(k, 0) + 1
    for kind in COMPUTE_KINDS:
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
