"""A workload on a cluster we do not have: compute from a cost model, communication from an
alpha-beta model per link class, the pipeline's messages and the overlap of started
collectives followed event by event.

Cluster description (``Cluster``; presets below, or a JSON file with the same keys):
``gpus_per_node``; ``matmul_tflops`` (the rate dense matmuls reach, not the datasheet peak)
and ``memory_GBps`` (what the other operators' bytes move at, and a measured matmul's
operands: ``gemm_efficiency``); ``intra`` / ``inter``:
``{"alpha_us", "bandwidth_GBps"}`` of a ring step inside a node (NVLink / shared memory) and
across nodes (InfiniBand / Ethernet), bandwidth per device; ``op_overhead_us``: host time
per operator call (dispatch between kernels, a GPU's launch), which a small model's step is
made of. A group whose ranks all sit on
one node uses ``intra``, any other ``inter`` (the mesh places tp innermost, then dp, then
pp: DESIGN.md's rank = (pp_i * dp + dp_i) * tp + tp_i, nodes filled in rank order).

Ranks that share cores (as when testing here) come to each meeting late by a part of the
compute before it (``meeting_ratio``, capped at ``meeting_cap_us`` while each rank has a core
of its own or is bound to one), and each collective costs them a fixed host time besides
(``meeting_us``); all 0 for dedicated devices.

Collective times are the ring algorithms' (as NCCL's and MPICH's large-message paths):
allreduce 2(n-1) alpha + 2(n-1)/n S/B, reduce-scatter / allgather / all-to-all
(n-1) alpha + (n-1)/n S/B, a pipeline message alpha + S/B; a bucket's reduce-scatter or
allgather of k tensors (ZeRO's) is k runtime calls, k (n-1) alpha + (n-1)/n S/B. Each rank
has one compute stream and one communication stream: a started collective runs on the
communication stream while compute goes on, a wait joins them, a blocking collective joins
them first. The ranks of one dp / tp group run the same program, so one rank per pipeline
stage is simulated: GPT-3 on 1024 ranks is 96 programs, answered in seconds.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from .workload import COLLECTIVES, Event, Workload, gemm_bytes, gemm_flops


@dataclasses.dataclass(frozen=True)
class Link:
    alpha_us: float
    bandwidth_GBps: float


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    matmul_tflops: float
    memory_GBps: float
    intra: Link
    inter: Link
    device_memory_gb: float = 80.0
    note: str = ""
    #: host time per operator call of a step (the VM's dispatch and the framework between
    #: kernels; a GPU's launch), added to the call's device time on the compute stream: a
    #: host that keeps ahead of an asynchronous GPU hides it, so on a device-bound step this
    #: overestimates by at most the calls' share (2.7 us x calls); ranks sharing a core pay
    #: it at their share (what ``calibrate`` measures with N ranks on this host)
    op_overhead_us: float = 0.0
    #: the members of a collective or of a pipeline message come to it from compute that the
    #: host's scheduler gave each a different share of, so the last arrives late by a part of
    #: the compute since its previous meeting: a meeting after W seconds of compute costs
    #: meeting_ratio x W more than its alpha-beta time, at most meeting_cap_us where that is
    #: not 0. Both 0 on dedicated devices (every preset but a calibrated cpu-here).
    #: ``calibrate`` measures the ratio by starting collectives from short compute chunks
    #: (bench/meeting_cost.py's loop), and the cap from long ones while every rank has a core
    #: of its own or is bound to one (``--bind-to core``); with more ranks than cores left to
    #: the scheduler it sets no cap: the lateness then grows with the
    #: compute (bench/RESULTS.md, "The oversubscribed dp step taken apart": the latest rank
    #: reached a dp step's gradient allreduce 0.33-0.43 x the phase after the median with 8
    #: ranks on 2 cores, 0.2 x with 4, the calibrated ratios 0.45 and 0.25), which the long
    #: chunks' loop, bounded at 3 ms there, does not show
    meeting_ratio: float = 0.0
    meeting_cap_us: float = 0.0
    #: time each collective of more than one rank takes beyond all of the above, added to its
    #: duration on whichever stream runs it (ranks sharing cores: the call handed to the
    #: communication thread and the result taken back, each a turn on a core other ranks'
    #: threads hold; the members leaving it at different times): ``calibrate`` measures it as
    #: what a step made of allreduces and operator calls (a tiny model under tensor
    #: parallelism over every rank) takes beyond its simulation, per collective. Once per
    #: collective event, as a bucket of k tensors is one hand-off (its k MPI calls run on the
    #: communication thread in one go); not on pipeline messages (isend / irecv, polled
    #: there: no caller hands a call over and waits). 0 on dedicated devices
    meeting_us: float = 0.0
    #: {"SIZExSTRIDE": [meeting_ratio, meeting_cap_us]} for the collectives' groups of SIZE
    #: ranks STRIDE apart that a mesh of this node's ranks meets in (tp blocks stride 1, dp
    #: stride tp, the pp axis stride dp x tp), every group of the shape meeting at once as
    #: in a step: ``calibrate`` measures each. Ranks sharing cores meet differently by group:
    #: with 8 ranks bound to 2 cores a meeting of 4 neighbouring ranks (2 on each core, the
    #: other 2 of each core in other groups) cost 1.08-1.12 x the compute before it, the
    #: whole node's 0.44-0.47, pairs' 0.38-0.46; with 4 ranks pairs 0.13-0.16 against
    #: 0.21-0.22 (bench/RESULTS.md). A group not in it, and a pipeline message (two ranks,
    #: but not a collective every group runs at once: stages send at different times), use
    #: meeting_ratio / meeting_cap_us, the whole node's
    meeting_groups: dict = dataclasses.field(default_factory=dict, hash=False)
    #: {gemm_key: rate of that float32 matmul / the rate of matmul_tflops' 1024^3 one}, as
    #: this host's BLAS runs them warm in a loop (``calibrate --gemm-shapes``). A step's
    #: matmuls are small next to 1024^3 and their rate depends on the shape (a pipeline's
    #: microbatch or a tensor-parallel slice runs smaller ones than the whole step), which one
    #: matmul rate cannot follow; and in a step each meets its operands out of cache (written
    #: by the kernels before it): a measured shape costs its flops at its own rate plus its
    #: operands' and result's bytes at ``memory_GBps`` (bench/RESULTS.md, "Matmuls by
    #: shape"). A matmul whose shape is not in it runs at matmul_tflops. Empty on the presets
    gemm_efficiency: dict = dataclasses.field(default_factory=dict, hash=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        data = dict(data)
        data["intra"] = Link(**data["intra"])
        data["inter"] = Link(**data["inter"])
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: presets. dgx-a100 / dgx-h100: NVIDIA's DGX figures (8 GPUs on NVSwitch; one 200 / 400 Gb/s
#: HCA per GPU) with achieved rather than peak rates: bf16 matmul ~80% of 312 / 989 TFLOP/s,
#: ring bus bandwidth ~80% of the link's (nccl-tests' busbw on such nodes). cpu-here: this
#: project's 2-core development machine as ``python -m raf_dist.proxies calibrate``
#: measured it under ``mpirun -np 2`` on 2026-11-27 (per rank, both ranks busy: numpy float32
#: GEMM 67 GFLOP/s, copy 13.8 GB/s, raf_dist allreduce alpha 10 us, bus bandwidth 1.9 GB/s;
#: 1.26 us per operator call, measured 2026-11-28; a 4 KiB allreduce met from compute
#: costs 0.11 x the compute before it, at most 0.2 ms more: meeting_ratio / meeting_cap_us,
#: 2026-11-29);
#: a saved calibration replaces it. op_overhead_us of the GPU presets: raf_dist's own host
#: time per operator call on an H200 (bench/RESULTS.md, gpu_check.sh: bench/step_time.py's
#: GPT, a host-bound step of 5.13 ms for the 1893 operator calls its extraction counts)
CLUSTERS = {
    "dgx-a100": Cluster("dgx-a100", 8, 250.0, 1600.0, Link(8.0, 230.0), Link(12.0, 20.0), 80.0,
                        "8x A100-80GB per node, NVSwitch, 8x HDR 200 Gb/s", op_overhead_us=2.7),
    "dgx-h100": Cluster("dgx-h100", 8, 790.0, 3000.0, Link(6.0, 360.0), Link(10.0, 40.0), 80.0,
                        "8x H100-SXM per node, NVSwitch, 8x NDR 400 Gb/s", op_overhead_us=2.7),
    "cpu-here": Cluster("cpu-here", 2, 0.067, 13.8, Link(10.3, 1.9), Link(10.3, 1.9), 23.5,
                        "this 2-core machine, one rank per core (calibrate, 2026-11-27)",
                        op_overhead_us=1.26, meeting_ratio=0.11, meeting_cap_us=200.0),
}
CALIBRATION_PATH = os.path.join(os.path.expanduser("~"), ".cache", "raf_dist", "cpu-here.json")


def load_cluster(spec: str) -> Cluster:
    """A preset name (``cpu-here`` reads its calibration when one was saved) or a JSON
    file."""
    if spec == "cpu-here" and os.path.exists(CALIBRATION_PATH):
        with open(CALIBRATION_PATH) as f:
            return Cluster.from_dict(json.load(f))
    if spec in CLUSTERS:
        return CLUSTERS[spec]
    if os.path.exists(spec):
        with open(spec) as f:
            data = json.load(f)
        try:
            return Cluster.from_dict(data)
        except (TypeError, KeyError) as e:
            raise ValueError(f"{spec}: a cluster description needs the keys name, "
                             "gpus_per_node, matmul_tflops, memory_GBps, intra, inter "
                             f"({{alpha_us, bandwidth_GBps}}): {e}") from e
    raise ValueError(f"unknown cluster {spec!r}: a preset ({', '.join(CLUSTERS)}) or a JSON "
                     "file")


def compute_seconds(event: Event, cluster: Cluster) -> float:
    rate, bandwidth = cluster.matmul_tflops * 1e12, cluster.memory_GBps * 1e9
    matmul = event.flops / rate
    if cluster.gemm_efficiency:  # the measured shapes at their own rates (Cluster)
        for key, calls in event.gemms.items():
            efficiency = cluster.gemm_efficiency.get(key)
            if efficiency is not None:
                flops = gemm_flops(key)
                matmul += calls * (flops / rate * (1 / efficiency - 1)
                                   + gemm_bytes(key) / bandwidth)
    return (matmul + event.mem_bytes / bandwidth + event.ops * cluster.op_overhead_us * 1e-6)


def meeting_seconds(compute_since_s: float, cluster: Cluster, group: str = "") -> float:
    """What a meeting costs beyond its alpha-beta time after ``compute_since_s`` of compute
    since the rank's previous one (``Cluster``): a collective of more than one rank, or a
    pipeline message, charged at its sender (its receiver's compute before the receive is
    hidden behind the wait for it); ``group`` its ``meeting_group`` (the ratio and cap
    measured for that group, if any)."""
    ratio, cap_us = cluster.meeting_groups.get(group, (cluster.meeting_ratio,
                                                       cluster.meeting_cap_us))
    late = ratio * compute_since_s
    return min(late, cap_us * 1e-6) if cap_us > 0 else late


def meeting_group(workload: Workload, event: Event, cluster: Cluster) -> str:
    """``"SIZExSTRIDE"`` of the ranks collective ``event`` meets (rank = (pp_i * dp + dp_i) *
    tp + tp_i: a tp group is tp neighbours, a dp group dp ranks tp apart, the pp axis pp ranks
    dp x tp apart), "" for a pipeline message and where ``cluster``'s table was calibrated
    with another number of ranks than the workload's (its groups sit on other cores):
    ``Cluster.meeting_groups``."""
    if (not cluster.meeting_groups or event.kind in ("send", "recv")
            or workload.world != cluster.gpus_per_node):
        return ""  # no table; a message; or a table measured with another number of ranks
    axis = event.axis or "pp"
    stride = {"tp": 1, "dp": workload.tp, "pp": workload.dp * workload.tp, "world": 1}[axis]
    return f"{group_size(workload, axis)}x{stride}"


def group_size(workload: Workload, axis: str) -> int:
    return {"dp": workload.dp, "tp": workload.tp, "pp": workload.pp,
            "world": workload.world}[axis]


def link(workload: Workload, axis: str, cluster: Cluster) -> Link:
    """The link class of ``axis``'s groups: intra-node when a whole group fits in a node."""
    span = {"tp": workload.tp, "dp": workload.tp * workload.dp,
            "pp": workload.world, "world": workload.world}[axis]
    return cluster.intra if span <= cluster.gpus_per_node else cluster.inter


def message_link(workload: Workload, src: int, dst: int, cluster: Cluster) -> Link:
    """A pipeline message between pp ranks ``src`` and ``dst`` (their dp 0 / tp 0 ranks, tp x
    dp apart): intra-node when both sit on one node."""
    stride = workload.tp * workload.dp
    same = (src * stride) // cluster.gpus_per_node == (dst * stride) // cluster.gpus_per_node
    return cluster.intra if same else cluster.inter


def comm_seconds(event: Event, workload: Workload, cluster: Cluster, rank: int = 0) -> float:
    """The alpha-beta time of a collective, or of a message from / to pp rank ``rank``
    (module docstring)."""
    n = group_size(workload, event.axis or "pp")
    lk = (message_link(workload, rank, event.peer, cluster) if event.kind in ("send", "recv")
          else link(workload, event.axis or "pp", cluster))
    alpha, beta = lk.alpha_us * 1e-6, lk.bandwidth_GBps * 1e9
    if event.kind in ("send", "recv"):
        return alpha + event.bytes / beta
    if n == 1:
        return 0.0
    # a bucket's reduce-scatter / allgather is one runtime call per tensor (Event.parts),
    # each paying its ring's latency
    ring = (n - 1) / n * event.bytes / beta
    if event.kind == "allreduce":
        return 2 * (n - 1) * alpha * event.calls + 2 * ring
    return (n - 1) * alpha * event.calls + ring


@dataclasses.dataclass
class Simulation:
    """Per pp rank: iteration time, compute, collective busy time (``comm_s``), the part of it
    compute did not hide (``exposed_s``), the time spent waiting for the neighbouring stages'
    messages (``pipeline_wait_s``: bubble and transfer), the lateness charged to its
    meetings (``meeting_s``, ranks sharing cores: ``Cluster.meeting_ratio`` and
    ``meeting_us``; inside
    ``comm_s`` for its collectives, in the arrival of the messages it sends); per kind
    count, bytes and time."""
    iteration_s: float
    per_rank: list[dict[str, float]]
    by_kind: dict[str, dict[str, float]]

    @property
    def bubble(self) -> float:
        """Idle share of the slowest pp rank (waiting for messages or collectives)."""
        busy = max(r["compute_s"] for r in self.per_rank)
        return 1.0 - busy / self.iteration_s if self.iteration_s else 0.0


def simulate(workload: Workload, cluster: Cluster) -> Simulation:
    """One iteration of ``workload`` on ``cluster`` (module docstring)."""
    P = workload.pp
    clock = [0.0] * P  # compute stream
    comm_free = [0.0] * P  # communication stream
    position = [0] * P
    handles: list[dict[int, float]] = [{} for _ in range(P)]
    arrivals: dict[tuple[int, int, int], float] = {}  # (src, dst, tag) -> arrival time
    # exposed_s: waited on collectives; pipeline_wait_s: waited on the previous / next stage
    stats = [{"compute_s": 0.0, "comm_s": 0.0, "exposed_s": 0.0, "pipeline_wait_s": 0.0,
              "meeting_s": 0.0} for _ in range(P)]
    since = [0.0] * P  # compute since the rank's previous meeting (Cluster.meeting_ratio)
    by_kind: dict[str, dict[str, float]] = {}
    progressed = True
    while progressed:
        progressed = False
        for r in range(P):
            program = workload.programs[r]
            while position[r] < len(program):
                e = program[position[r]]
                if e.kind == "recv" and (e.peer, r, e.tag) not in arrivals:
                    break  # its sender has not got there yet
                position[r] += 1
                progressed = True
                if e.kind == "compute":
                    dt = compute_seconds(e, cluster)
                    clock[r] += dt
                    stats[r]["compute_s"] += dt
                    since[r] += dt
                    continue
                if e.kind == "wait":
                    done = handles[r].pop(e.handle)
                    stats[r]["exposed_s"] += max(0.0, done - clock[r])
                    clock[r] = max(clock[r], done)
                    continue
                dt = comm_seconds(e, workload, cluster, r)
                if e.kind == "recv":  # the sender's lateness is in the message's arrival
                    since[r] = 0.0
                elif e.kind == "send" or group_size(workload, e.axis or "pp") > 1:
                    late = meeting_seconds(since[r], cluster,
                                           meeting_group(workload, e, cluster))
                    if e.kind != "send":
                        late += cluster.meeting_us * 1e-6
                    dt += late
                    stats[r]["meeting_s"] += late
                    since[r] = 0.0
                if r == 0 or e.kind in ("send", "recv"):
                    row = by_kind.setdefault(e.kind, {"count": 0, "bytes": 0, "seconds": 0.0})
                    row["count"] += 1
                    row["bytes"] += e.bytes
                    row["seconds"] += dt
                if e.kind not in ("send", "recv"):
                    stats[r]["comm_s"] += dt
                if e.kind == "send":  # non-blocking: the message leaves as the data is ready
                    arrivals[(r, e.peer, e.tag)] = clock[r] + dt
                elif e.kind == "recv":
                    done = arrivals.pop((e.peer, r, e.tag))
                    stats[r]["pipeline_wait_s"] += max(0.0, done - clock[r])
                    clock[r] = max(clock[r], done)
                elif e.handle >= 0:
                    start = max(clock[r], comm_free[r])
                    comm_free[r] = handles[r][e.handle] = start + dt
                else:
                    start = max(clock[r], comm_free[r])
                    stats[r]["exposed_s"] += start + dt - clock[r]
                    clock[r] = comm_free[r] = start + dt
    stuck = [r for r in range(P) if position[r] < len(workload.programs[r])]
    if stuck:
        raise ValueError(f"the workload's pipeline messages do not match: pp ranks {stuck} "
                         "wait for messages no rank sends (or sends only after its own "
                         "receive: a cycle)")
    for r in range(P):
        stats[r]["iteration_s"] = clock[r]
    return Simulation(max(clock), stats, by_kind)


def kinds_of(workload: Workload) -> list[str]:
    return [k for k in COLLECTIVES + ("send", "recv") if k in workload.totals()]
