"""What a proxy replays: each pipeline rank's program of compute and communication events.

A :class:`Workload` holds one :class:`Event` list per pp rank (the ranks that differ only in
their dp or tp index run the same program on other data: SPMD), the mesh it was extracted
for, and where it came from. It is plain data (``to_json`` / ``from_json``): a launcher
extracts it once from a compiled step (proxies/extract.py) and every replay rank reads it,
so replay processes compile nothing.

Event kinds:
- ``compute``: ``flops`` (matmul / convolution multiply-adds x 2), ``mem_bytes`` (bytes
  the other operators write) and ``ops`` (the step's Relax operator calls before fusion,
  markers and views included: the unit ``calibrate`` measures the host's time per call in,
  so fusion's ratio is in the calibration), timed by the cost model (proxies/simulate.py
  ``compute_seconds``).
- ``allreduce`` / ``reduce_scatter`` / ``allgather`` / ``alltoall`` over ``axis`` (``"dp"``,
  ``"tp"``, ``"pp"`` or ``"world"``): ``bytes`` is the whole tensor (reduce-scatter's input,
  allgather's output, alltoall's send buffer). ``handle`` >= 0: started here, completed by
  the ``wait`` event with the same handle (the step's overlap points); -1: blocking.
- ``send`` / ``recv``: a pipeline message of ``bytes`` to / from pp rank ``peer``, ``tag``
  as the pipeline transport tags it (runtime/transport.py).
- ``wait``: completes the collective started with ``handle``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import numpy as np

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "alltoall")
KINDS = ("compute", *COLLECTIVES, "send", "recv", "wait")
AXES = ("dp", "tp", "pp", "world")


def gemm_key(a_shape, b_shape, trans_a: bool, trans_b: bool) -> str:
    """The name of one BLAS matmul: its operands' shapes as stored and whether each is
    read transposed (DispatchToBLAS folds a swap of the last two axes into a flag), e.g.
    ``"256x128,512x128,01"``: ``a @ b.T`` of a 256 x 128 and a 512 x 128."""
    return (f"{'x'.join(str(int(d)) for d in a_shape)},"
            f"{'x'.join(str(int(d)) for d in b_shape)},{int(trans_a)}{int(trans_b)}")


def parse_gemm_key(key: str) -> tuple[list[int], list[int], bool, bool]:
    """(a shape, b shape, trans_a, trans_b) of a ``gemm_key``; ValueError naming the key and
    the expected form when it is not one."""
    try:
        a, b, flags = key.split(",")
        shapes = [int(d) for d in a.split("x")], [int(d) for d in b.split("x")]
        if len(flags) != 2 or set(flags) - {"0", "1"} or min(map(len, shapes)) < 2:
            raise ValueError
        np.broadcast_shapes(tuple(shapes[0][:-2]), tuple(shapes[1][:-2]))
    except ValueError:
        raise ValueError(f"{key!r} is not a matmul shape: expected 'AxB,CxD,tt' (each operand's "
                         "shape, at least 2-D, batch dimensions broadcastable, then a 0/1 "
                         "transpose flag for each), e.g. '256x128,512x128,01'") from None
    return shapes[0], shapes[1], flags[0] == "1", flags[1] == "1"


@functools.lru_cache(maxsize=None)
def _gemm_dims(key: str) -> tuple[int, int, int, int, int]:
    """(batch, m, n, k, elements of a and b) of the matmul ``key``: the batch dimensions
    broadcast, as numpy's matmul."""
    a, b, trans_a, trans_b = parse_gemm_key(key)
    m, k = (a[-1], a[-2]) if trans_a else (a[-2], a[-1])
    n = b[-2] if trans_b else b[-1]
    batch = math.prod(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))
    return batch, m, n, k, math.prod(a) + math.prod(b)


def gemm_bytes(key: str) -> int:
    """Bytes one call of the float32 matmul ``key`` reads and writes: its operands and its
    result."""
    batch, m, n, _, operands = _gemm_dims(key)
    return 4 * (operands + batch * m * n)


def gemm_flops(key: str) -> int:
    """Multiply-add FLOPs (x2) of one call of the matmul ``key``."""
    batch, m, n, k, _ = _gemm_dims(key)
    return 2 * batch * m * n * k


@dataclasses.dataclass
class Event:
    kind: str
    bytes: int = 0
    axis: str = ""
    handle: int = -1
    flops: int = 0
    mem_bytes: int = 0
    ops: int = 0
    peer: int = -1
    tag: int = -1
    what: str = ""  # where it came from, for people reading a listing
    parts: list[int] = dataclasses.field(default_factory=list)
    #: compute: {gemm_key: calls} of its float32 matmuls (module docstring)
    gemms: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; expected one of {KINDS}")
        if self.kind in COLLECTIVES and self.axis not in AXES:
            raise ValueError(f"a {self.kind} needs an axis in {AXES}, got {self.axis!r}")
        if self.parts and sum(self.parts) != self.bytes:
            raise ValueError(f"a {self.kind}'s parts ({sum(self.parts)} bytes) must add up to "
                             f"its bytes ({self.bytes})")

    @property
    def calls(self) -> int:
        """The native runtime's calls for this event (one per tensor of a bucket)."""
        return max(1, len(self.parts))

    def to_dict(self) -> dict[str, Any]:
        defaults = Event("compute")
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k == "kind" or v != getattr(defaults, k)}


@dataclasses.dataclass
class Workload:
    """Per pp rank, the events of one training iteration (``programs[pp_rank]``)."""
    name: str
    dp: int
    tp: int
    pp: int
    zero: int
    microbatches: int
    schedule: str
    programs: list[list[Event]]
    dtype_bytes: int = 4
    source: str = ""  # how it was obtained ("extracted from ...", "described ...")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def collectives(self, pp_rank: int = 0) -> list[Event]:
        """The communication events of one pp rank's program, in order."""
        return [e for e in self.programs[pp_rank] if e.kind in COLLECTIVES + ("send", "recv")]

    def totals(self, pp_rank: int | None = None) -> dict[str, dict[str, int]]:
        """{kind: {"count", "bytes"}} of the communication (every pp rank's, or one's)."""
        out: dict[str, dict[str, int]] = {}
        ranks = range(self.pp) if pp_rank is None else [pp_rank]
        for r in ranks:
            for e in self.collectives(r):
                row = out.setdefault(e.kind, {"count": 0, "bytes": 0})
                row["count"] += 1
                row["bytes"] += e.bytes
        return out

    def bus_bytes(self, pp_rank: int) -> dict[str, dict[str, dict[str, float]]]:
        """{axis: {kind: {"calls", "bus_bytes"}}} of one pp rank's collectives, with bus bytes
        as the native runtime counts them (``dist.comm_counters``: nccl-tests' definition),
        so a real step's per-group counters can be compared with the extraction."""
        sizes = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "world": self.world}
        factor = {"allreduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                  "allgather": lambda n: (n - 1) / n, "alltoall": lambda n: (n - 1) / n}
        out: dict[str, dict[str, dict[str, float]]] = {}
        for e in self.programs[pp_rank]:
            if e.kind not in COLLECTIVES:
                continue
            row = out.setdefault(e.axis, {}).setdefault(e.kind, {"calls": 0, "bus_bytes": 0.0})
            row["calls"] += 1
            row["bus_bytes"] += factor[e.kind](sizes[e.axis]) * e.bytes
        return out

    def in_16_bit(self) -> Workload:
        """This workload as a bf16 / fp16 run would move it (the extraction builds float32
        steps; pipelining has no mixed precision yet): activations, their gradients, the
        gradient reductions and the other operators' bytes halved; FLOPs unchanged; the
        4-byte loss and flag reductions kept. Used by the simulator for published 16-bit
        runs (Megatron's); a replay of it is what a 16-bit step would send."""
        def half(e: Event) -> Event:
            e = dataclasses.replace(e)
            if e.bytes > 8:
                e.bytes //= 2
                if e.parts:  # each tensor halved; their sum stays the bucket's bytes
                    e.parts = [b // 2 for b in e.parts]
                    e.bytes = sum(e.parts)
            e.mem_bytes //= 2
            e.gemms = {}  # the measured shapes are float32's: 16-bit matmuls at the rate
            return e

        return dataclasses.replace(self, programs=[[half(e) for e in p] for p in self.programs],
                                   dtype_bytes=2, source=self.source + "; bytes as 16-bit")

    def device_flops(self) -> float:
        """Matmul and convolution FLOPs one device runs per iteration, averaged over the pp
        ranks (recomputation included, as Megatron-LM counts them)."""
        return sum(self.flops(r) for r in range(self.pp)) / self.pp

    def flops(self, pp_rank: int) -> int:
        return sum(e.flops for e in self.programs[pp_rank])

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["programs"] = [[e.to_dict() for e in p] for p in self.programs]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> Workload:
        data = json.loads(text)
        data["programs"] = [[Event(**e) for e in p] for p in data["programs"]]
        return cls(**data)
