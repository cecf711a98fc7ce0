"""``mpirun -np 2 python -m raf_dist.proxies calibrate [--calibration-out FILE]``: measure
this machine for the ``cpu-here`` cluster (proxies/simulate.py) and save it
(~/.cache/raf_dist/cpu-here.json, which ``--cluster cpu-here`` then reads, or FILE, a cluster
JSON for ``--cluster FILE``). With N ranks on fewer cores it measures N ranks sharing them,
each with the compute threads a Trainer would give it (cores / ranks on the host). Every
compute figure is a rate over a fixed window that all ranks start together after a barrier
(``window_rate``), so each rank's work runs while every other rank runs its own, as in a
step: float32 GEMM rate (numpy's BLAS, 1024^3), copy bandwidth (64 MiB; with several ranks
rank 0's alone times its share of the core, ``measure``), and the host time
per operator call: every rank trains its own copy of a model whose tensors are tiny (no
communication; the compute is negligible, so a step is its calls: the VM's dispatch, the
kernels' entry, the Trainer's Python), its step time over the window divided by the step's
operator count as the extraction counts them (proxies/extract.py). (A best-of-5 without
the common window, as before 2026-11-29, let ranks measure while others were still
importing: with 8 ranks on 2 cores, 47 GFLOP/s and 3.8 GB/s per rank against 30.5 and 2.3
over a common window.) raf_dist's allreduce between the ranks: alpha from 4 KiB calls, bus
bandwidth from 64 MiB ones (medians of 20 and 5, between barriers); and what a collective
met from compute costs beyond that (``_meeting``: with more ranks than cores, the members
arrive late by a part of the compute before it; no cap where the scheduler places them,
``ranks_float_on_shared_cores``; for every group shape a mesh of these ranks meets in,
``_meeting_groups``), and the host time each
collective costs beyond everything else (``_meeting_us``: the tiny model's tensor-parallel
step against its simulation). With ``--gemm-shapes FILE`` (a JSON list of ``gemm_key``s) the
rate of each of those matmuls against the 1024^3 one (``gemm_efficiency``)."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import numpy as np
from tvm.relax.frontend import nn

from .simulate import CALIBRATION_PATH, Cluster, Link


#: seconds of each measurement window (every rank busy through it)
WINDOW_S = 2.0


def alone(comm, fn):
    """``fn()`` on rank 0 of ``comm`` while every other rank sleeps (a non-blocking barrier
    polled every 5 ms: MPI's blocking barrier spins a core); its result on rank 0, None on
    the others."""
    result = fn() if comm.rank == 0 else None
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)
    return result


def window_rate(comm, fn, seconds: float | None = None) -> float:
    """Calls of ``fn`` per second on this rank over a ``seconds`` window (default
    ``WINDOW_S``) that every rank of ``comm`` starts together (one call first, outside it:
    first-call set-up)."""
    seconds = WINDOW_S if seconds is None else seconds
    fn()
    comm.Barrier()
    began = time.perf_counter()
    calls = 0
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - began
        if elapsed >= seconds:
            return calls / elapsed


class _TinyMLP(nn.Module):
    """The calibration's model: a layer norm and 8 linear + GELU layers of width 16, so a
    step is its operator calls (raf_dist.nn: calibrate needs no torch)."""

    def __init__(self) -> None:
        self.norm = nn.LayerNorm(16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(8)])
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        x = self.norm(x)
        for layer in self.layers:
            x = nn.op.gelu(layer(x))
        return self.head(x)


#: what a calibration builds once per process and measures again on a later call (the tiny
#: model's Trainers, the meeting groups' native ids): a job that calibrates between the
#: steps of its own Trainers (bench/plan_validation.py) calls ``measure`` every round
_BUILT: dict = {}


def _with_parallelism(fields: dict, build):
    """``build()`` under the calibration's own parallelism (``fields`` over a lone rank's: no
    dp, ZeRO, pipelining or tables), the user's config back afterwards whatever happens."""
    from raf_dist import distributed as dist

    from ..runtime.plan import PARALLELISM_FIELDS

    config = dist.get_config()
    saved = {k: getattr(config, k) for k in (*PARALLELISM_FIELDS, "num_microbatches")}
    try:
        config.update({"enable_data_parallel": False, "zero_opt_level": 0,
                       "embedding_parallel": "none", "pipeline_parallel_size": 1,
                       "tensor_parallel_size": 1, "num_microbatches": 1, **fields})
        return build()
    finally:
        config.update(saved)


def _op_overhead_us(comm) -> float:
    """Microseconds of host time per operator call with every rank stepping at once (module
    docstring): the median over the ranks of each one's median step / its operator count."""
    import raf_dist

    from .extract import MeshSpec, extract

    if "local" not in _BUILT:
        model = raf_dist.frontend.from_relax_nn(_TinyMLP(), [((4, 16), "float32")])
        ops = sum(e.ops for e in extract(model, MeshSpec()).programs[0])
        # this rank alone (no data parallelism whatever the config says): no communication
        _BUILT["local"] = (ops, _with_parallelism({}, lambda: raf_dist.Trainer(
            model, optimizer=raf_dist.optim.AdamW(lr=1e-3), local=True)))
    ops, trainer = _BUILT["local"]
    rng = np.random.default_rng(comm.rank)
    xs = rng.standard_normal((4, 16), np.float32)
    ys = rng.integers(0, 8, (4,))
    for _ in range(5):
        trainer.step(xs, ys)
    steps_per_s = window_rate(comm, lambda: trainer.step(xs, ys), 1.5 * WINDOW_S)
    return statistics.median(comm.allgather(1e6 / steps_per_s / ops))


#: the compute chunks a meeting is measured after: 8 float32 GEMMs of each size (short and
#: long against a scheduler's turn once ranks share cores: ~1.4 and ~28 ms with 8 ranks on 2)
MEETING_GEMM_SIZES = (128, 384)


def _lockstep_seconds(comm, body, seconds: float, probe=None) -> float:
    """The slowest rank's mean seconds per call of ``body``, called the same number of times
    on every rank after a barrier: as many as fit ``seconds`` by one timed call of ``probe``
    (default ``body``; the slowest rank's), at least 5. A count per rank would leave some
    ranks in a collective the others never call."""
    from mpi4py import MPI

    began = time.perf_counter()
    (probe or body)()
    one = comm.allreduce(time.perf_counter() - began, op=MPI.MAX)
    iterations = max(5, int(seconds / max(one, 1e-6)))
    comm.Barrier()
    began = time.perf_counter()
    for _ in range(iterations):
        body()
    return comm.allreduce((time.perf_counter() - began) / iterations, op=MPI.MAX)


def meeting_times(comm, sizes=MEETING_GEMM_SIZES, seconds: float = 1.0, group=None) -> list:
    """``[(compute_s, with_allreduce_s)]`` per size: every rank repeats a chunk of 8 float32
    GEMMs of SIZE^3 alone and then followed by a 4 KiB raf_dist allreduce (over ``group``, a
    native group id: default every rank), the same number
    of times (fixed from a first timed chunk, the slowest rank's), the slowest rank's time per
    iteration, best of two each, alternating (bench/meeting_cost.py prints the table)."""
    from ..distributed import collectives

    flag = np.ones(1024, np.float32)
    out = []
    for size in sizes:
        a = np.random.default_rng(0).standard_normal((size, size), np.float32)

        def chunk(a=a):
            for _ in range(8):
                a @ a

        def meet(chunk=chunk):
            chunk()
            collectives.allreduce(flag, "sum", flag, group=group)

        best: dict = {}
        for mode in ("compute", "meet", "compute", "meet"):
            per = _lockstep_seconds(comm, chunk if mode == "compute" else meet, seconds,
                                    probe=chunk)
            best[mode] = min(best.get(mode, per), per)
        out.append((best["compute"], best["meet"]))
    return out


def _meeting(comm, shared: bool, group=None) -> tuple[float, float]:
    """``(meeting_ratio, meeting_cap_us)`` of ``Cluster`` (proxies/simulate.py) from
    ``meeting_times`` over ``group`` (default every rank): a meeting's cost is the chunk with
    the allreduce less the chunk alone;
    the ratio is the short chunk's cost over its length (the cap does not bind there), the cap
    the largest cost seen, none (0) when the ranks outnumber the host's cores unbound
    (``shared``, ``ranks_float_on_shared_cores``; ``Cluster.meeting_cap_us`` says why)."""
    # the long chunk serves the cap alone: not measured where there is none
    sizes = MEETING_GEMM_SIZES[:1] if shared else MEETING_GEMM_SIZES
    costs = [(compute, max(0.0, meet - compute))
             for compute, meet in meeting_times(comm, sizes, group=group)]
    short, cost = costs[0]
    return cost / short, 0.0 if shared else max(c for _, c in costs) * 1e6


def meeting_group_shapes(n: int) -> list[tuple[int, int]]:
    """(size, stride) of every group of at least two ranks a mesh of ``n`` ranks meets in
    (``simulate.meeting_group``): size x stride divides n; the whole job is (n, 1)."""
    return [(size, stride) for stride in range(1, n + 1) if n % stride == 0
            for size in range(2, n // stride + 1) if (n // stride) % size == 0]


def group_color(rank: int, size: int, stride: int) -> int:
    """Which group of ``size`` ranks ``stride`` apart ``rank`` is in: blocks of size x stride
    ranks, each split by the rank's place modulo the stride (a dp group of a tp-innermost
    mesh is such a group with stride tp)."""
    return rank // (size * stride) * stride + rank % stride


def _meeting_groups(comm, shared: bool) -> dict:
    """``Cluster.meeting_groups``: ``_meeting`` over each group shape of this job's ranks
    (``meeting_group_shapes``; every rank in one group of the shape, all groups meeting at
    once), the whole job's over the world group itself."""
    from mpi4py import MPI

    from .. import _native

    out = {}
    for size, stride in meeting_group_shapes(comm.size):
        group = None
        if size < comm.size:  # made once per process (_BUILT): native groups are not freed
            key = ("group", comm.size, size, stride)
            if key not in _BUILT:
                sub = comm.Split(group_color(comm.rank, size, stride), key=comm.rank)
                _BUILT[key] = (sub, int(_native.func("init_group")(MPI._addressof(sub), False)))
            group = _BUILT[key][1]
        ratio, cap_us = _meeting(comm, shared, group)
        out[f"{size}x{stride}"] = [round(ratio, 4), round(cap_us, 1)]
    return out


#: the width of calibrate's tiny model, which tensor parallelism over the ranks must divide
_TINY_WIDTH = 16


def _meeting_us(comm, cluster: Cluster) -> float:
    """``Cluster.meeting_us``: the tiny model's step under tensor parallelism over every rank
    (its compute negligible, so a step is its operator calls and its allreduces), the slowest
    rank's mean per window, the median of three 1 s windows after a discarded one
    (``_lockstep_seconds``), less that step simulated on
    ``cluster`` (every other term calibrated), over the step's collectives of more than one
    rank. 0 where the ranks do not divide the model's width (its layers would stay whole: no
    collective to measure)."""
    import raf_dist

    from .extract import MeshSpec, extract
    from .simulate import group_size, simulate
    from .workload import COLLECTIVES

    if _TINY_WIDTH % comm.size:
        return 0.0
    if ("tp", comm.size) not in _BUILT:
        model = raf_dist.frontend.from_relax_nn(_TinyMLP(), [((4, _TINY_WIDTH), "float32")])
        workload = extract(model, MeshSpec(tp=comm.size))
        meetings = sum(1 for e in workload.programs[0]
                       if e.kind in COLLECTIVES and group_size(workload, e.axis or "pp") > 1)
        trainer = meetings and _with_parallelism(
            {"tensor_parallel_size": comm.size},
            lambda: raf_dist.Trainer(model, optimizer=raf_dist.optim.AdamW(lr=1e-3)))
        _BUILT[("tp", comm.size)] = (workload, meetings, trainer)
    workload, meetings, trainer = _BUILT[("tp", comm.size)]
    if not meetings:
        return 0.0
    rng = np.random.default_rng(0)  # every rank the same rows (tensor parallelism)
    xs = rng.standard_normal((4, _TINY_WIDTH), np.float32)
    ys = rng.integers(0, 8, (4,))
    for _ in range(5):
        trainer.step(xs, ys)
    # each step meets the other ranks: the same number of steps on every rank; a first window
    # discarded (ranks sharing cores step slower until the scheduler settles), then the median
    # of three (bench/RESULTS.md, "Steady steps": one window of one job swung 2x)
    step = lambda: trainer.step(xs, ys)  # noqa: E731
    _lockstep_seconds(comm, step, WINDOW_S / 2)
    step_s = statistics.median(_lockstep_seconds(comm, step, WINDOW_S / 2) for _ in range(3))
    missing = (step_s - simulate(workload, cluster).iteration_s) / meetings
    return max(0.0, missing) * 1e6


def _seconds_per_call(fn, budget_s: float) -> float:
    """Median seconds of one ``fn()`` over five runs of as many calls as fit a fifth of
    ``budget_s`` (one call first: first-call set-up)."""
    began = time.perf_counter()
    fn()
    one = max(time.perf_counter() - began, 1e-7)
    calls = max(1, int(budget_s / 5 / one))
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - began) / calls)
    return statistics.median(runs)


def gemm_efficiency(keys, budget_s: float = 0.05) -> dict:
    """{gemm_key: this shape's float32 matmul rate / the rate of a 1024^3 one}, each run as
    a step runs it: ``raf_dist.blas.matmul`` (numpy's BLAS; a batch of small matrices spread
    by ``openblas.batched_matmul``) on runtime tensors of those shapes, transposes as flags
    (``Cluster.gemm_efficiency``). ~``budget_s`` per shape on this process's threads; the
    1024^3 reference is measured the same way, just before."""
    import tvm

    from ..runtime import blas
    from .workload import gemm_flops, parse_gemm_key

    rng = np.random.default_rng(0)

    def matmul_rate(a_shape, b_shape, trans_a, trans_b, flops):
        a, b = (tvm.runtime.tensor(rng.standard_normal(s, np.float32)) for s in (a_shape, b_shape))
        lhs = np.swapaxes(a.numpy(), -1, -2) if trans_a else a.numpy()
        rhs = np.swapaxes(b.numpy(), -1, -2) if trans_b else b.numpy()
        out = tvm.runtime.tensor(np.empty(np.matmul(lhs, rhs).shape, np.float32))
        return flops / _seconds_per_call(lambda: blas.matmul(a, b, trans_a, trans_b, out),
                                         budget_s)

    reference = matmul_rate([1024, 1024], [1024, 1024], False, False, 2 * 1024 ** 3)
    out = {}
    for key in sorted(set(keys)):
        a_shape, b_shape, trans_a, trans_b = parse_gemm_key(key)
        ratio = matmul_rate(a_shape, b_shape, trans_a, trans_b, gemm_flops(key)) / reference
        out[key] = float(f"{ratio:.4g}")
    return out


def ranks_float_on_shared_cores(comm) -> bool:
    """Whether on some host the ranks outnumber the cores they may run on together (the union
    of their affinity masks) with none bound to a part of them. Bound ranks (a launcher's
    ``--bind-to core``: each a mask of one core, round robin) keep their share of their own
    core, so a meeting's lateness after long compute stays bounded and the long chunks'
    cap is kept; ranks left to the scheduler drift apart with the compute (no cap:
    ``Cluster.meeting_cap_us``). A rank's own mask alone cannot tell: bound, it is one core
    whatever the others have. Every rank decides from the same gathered list (the answer
    sets how many collectives ``_meeting`` runs)."""
    import socket

    hosts: dict[str, list[set[int]]] = {}
    for host, mask in comm.allgather((socket.gethostname(), sorted(os.sched_getaffinity(0)))):
        hosts.setdefault(host, []).append(set(mask))
    for masks in hosts.values():
        cores = set().union(*masks)
        if len(masks) > len(cores) and all(m == cores for m in masks):
            return True
    return False


def calibrate(out_path: str = CALIBRATION_PATH, gemm_keys=()) -> int:
    """Measure this host with this job's ranks (``measure`` over MPI's world) and save the
    cluster to ``out_path`` (rank 0 writes it and prints it)."""
    from mpi4py import MPI

    cluster = measure(MPI.COMM_WORLD, gemm_keys)
    if MPI.COMM_WORLD.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(cluster.to_dict(), f, indent=1)
        print(json.dumps(cluster.to_dict()))
        print(f"saved to {out_path}")
    return 0


def measure(comm, gemm_keys=()) -> Cluster:
    """This host measured with the ranks of ``comm`` (an mpi4py communicator; module
    docstring), collective over it; ``gemm_keys``: matmul shapes (``gemm_key``, a
    workload's ``Event.gemms``) whose rates to measure too (``Cluster.gemm_efficiency``; the
    median over the ranks, each measuring its own from a common barrier on, so the others run
    theirs meanwhile). ``MPI.COMM_SELF`` in a job of N ranks measures this rank's compute
    alone (with the threads a rank of that job gets); the groups and tiny Trainers it makes
    are kept for the process's later calls (``_BUILT``)."""
    from mpi4py import MPI

    from ..distributed import collectives, get_communicator
    from ..runtime.threads import set_num_threads, threads_per_rank

    n = comm.size
    if n not in (1, MPI.COMM_WORLD.size):  # its allreduces run over the world's group
        raise ValueError(f"calibrate.measure: a communicator of {n} ranks; it measures with "
                         f"every rank of the job ({MPI.COMM_WORLD.size}) or one alone "
                         "(MPI.COMM_SELF)")
    # each rank's compute threads as a Trainer sizes them (cores / ranks on this host): the
    # rates measured are the ones a step of N ranks gets, not N oversubscribed BLAS pools
    set_num_threads(threads_per_rank(get_communicator().local_size))
    a = np.random.default_rng(0).standard_normal((1024, 1024), np.float32)
    # the median rank's rates (each rank's over the common window: module docstring)
    src = np.ones(16 * 2**20, np.float32)
    dst = np.empty_like(src)

    def gemm_rate(over):  # FLOP/s
        return 2 * 1024 ** 3 * window_rate(over, lambda: a @ a)

    def copy_rate(over):  # bytes/s, read + write
        return 2 * src.nbytes * window_rate(over, lambda: np.copyto(dst, src))

    gemm = statistics.median(comm.allgather(gemm_rate(comm)))
    if n == 1:
        copy = copy_rate(comm)
    else:
        # the rate a step's other operators move bytes at: rank 0's copy rate alone on its
        # core times the share of the core it gets (its GEMM rate with every rank running
        # over its GEMM rate alone). A step's tensors are a few MiB, in cache: ranks sharing
        # a core take turns at its full rate; 64 MiB copies of every rank at once would
        # also fight for DRAM, which the steps do not (bench/RESULTS.md "The validation in
        # interleaved jobs": at 8 ranks 4-6 GB/s that way against 21-27 alone for a 4x
        # share of the GEMM rate)
        solo_gemm, solo_copy = comm.bcast(alone(comm, lambda: (gemm_rate(MPI.COMM_SELF),
                                                               copy_rate(MPI.COMM_SELF))))
        copy = solo_copy * gemm / solo_gemm

    def allreduce_median(elements, repeats):
        x = np.ones(elements, np.float32)
        times = []
        for _ in range(repeats):
            comm.Barrier()
            began = time.perf_counter()
            collectives.allreduce(x, "sum", x)
            times.append(comm.allreduce(time.perf_counter() - began, op=MPI.MAX))
        return statistics.median(times)

    op_us = _op_overhead_us(comm)
    if n > 1:
        small = allreduce_median(1024, 20)
        big_elements = 16 * 2**20
        big = allreduce_median(big_elements, 5)
        alpha = small / (2 * (n - 1))
        bus = 2 * (n - 1) / n * big_elements * 4 / max(big - 2 * (n - 1) * alpha, 1e-9)
        link = Link(round(alpha * 1e6, 2), round(bus / 1e9, 3))
        groups = _meeting_groups(comm, ranks_float_on_shared_cores(comm))
        meeting_ratio, meeting_cap_us = groups[f"{n}x1"]
    else:  # one process: its compute rates only (no link to measure, no one to meet)
        link = Link(0.0, 1e6)
        meeting_ratio, meeting_cap_us, groups = 0.0, 0.0, {}
    cluster = Cluster("cpu-here", n, round(gemm / 1e12, 4), round(copy / 1e9, 2), link, link,
                      round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                      f"measured {time.strftime('%Y-%m-%d')} with {n} ranks on this host",
                      op_overhead_us=round(op_us, 2), meeting_ratio=round(meeting_ratio, 4),
                      meeting_cap_us=round(meeting_cap_us, 1), meeting_groups=groups)
    if n > 1:
        cluster = dataclasses.replace(cluster, meeting_us=round(_meeting_us(comm, cluster), 1))
    if gemm_keys:
        comm.Barrier()
        mine = gemm_efficiency(gemm_keys)
        every = comm.allgather(mine)
        cluster = dataclasses.replace(cluster, gemm_efficiency={
            key: statistics.median(e[key] for e in every) for key in mine})
    return cluster
