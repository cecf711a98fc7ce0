"""Replay a workload's communication through raf_dist's native runtime under MPI, compute
slept for the cost model's durations (the seeds' proxies ``usleep`` theirs).

Every rank runs its pp rank's program (workload.py): collectives go through
``raf_dist.distributed.collectives`` on this mesh's groups (``dist.get_mesh()``: the same
native groups, timeouts, counters and flight recorder a training step uses), started ones
waited where the step waits them; pipeline messages go as the PipelineExecutor sends them
(mpi4py ``Isend`` / ``Irecv`` on the pp communicator, every receive of the iteration posted
first, the transport's tags). Buffers are float32 scratch, reused: a message larger than
``max_buffer_mb`` travels in chunks of that size (blocking, one after the other: such a
started collective loses its overlap), and a started collective's buffers are let go at its
wait, so 32 ranks of GPT-2's stages fit this 24 GiB machine. Pipeline messages are not
chunked: each receive has its own buffer, allocated once. Waits poll and sleep (MPICH's
blocking waits spin, taking the cores of the ranks they wait for when ranks outnumber
cores) under RAF_DIST_COLLECTIVE_TIMEOUT_S. An uneven all-to-all (the embedding exchanges)
is replayed in equal blocks of the same total. The payload is garbage; the sizes, order, groups
and overlap points are the step's.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from .. import _native
from .simulate import Cluster, compute_seconds
from .workload import Workload


#: compute shorter than this is carried over and slept with the next (one sleep overshoots
#: by ~50-100 us on Linux; what is left is slept at the end of the iteration), so the total
#: stays the cost model's while a short piece may move past a collective
_MIN_SLEEP_S = 5e-4


class _Buffers:
    """float32 scratch by role (send / receive of a collective), capped; a started
    collective's arrays go back to a free list at its wait and serve the next ones, so an
    iteration allocates only what is in flight at once, and only on the first iteration."""

    def __init__(self, cap_bytes: int):
        self.cap = max(4, int(cap_bytes)) // 4
        self.arrays: dict[str, np.ndarray] = {}
        self.free: list[np.ndarray] = []

    def release(self, role: str) -> None:
        """Let a started collective's buffers go (at its wait)."""
        for suffix in ("s", "r"):
            array = self.arrays.pop(role + suffix, None)
            if array is not None:
                self.free.append(array)

    def get(self, role: str, elements: int) -> np.ndarray:
        elements = max(1, min(int(elements), self.cap))
        have = self.arrays.get(role)
        if have is None or have.size < elements:
            fits = [i for i, a in enumerate(self.free) if a.size >= elements]
            if fits:
                best = min(fits, key=lambda i: self.free[i].size)
                have = self.free.pop(best)
            else:
                have = np.zeros(elements, np.float32)
            self.arrays[role] = have
        return have[:elements]


def _floats(nbytes: int) -> int:
    """float32 elements of a message of ``nbytes`` (at least one)."""
    return -(-max(nbytes, 4) // 4)


def _bucket(kind: str, parts: list[int], group: int, size: int, buffers: _Buffers,
            async_op: bool, handle_key: str):
    """A bucket's reduce-scatter / allgather as the step runs it (``Event.parts``): one
    native call over the bucket's tensors, which the runtime runs as one collective per
    tensor into / from their padded shards. The caller checks that the bucket fits the cap."""
    from ..distributed import collectives as C

    counts = [_floats(b) for b in parts]
    shards = [-(-c // size) for c in counts]
    # a started bucket keeps its buffers until its wait; blocking ones share theirs (as the
    # flat path's)
    key = handle_key if async_op else "blocking"
    full = buffers.get(key + "s", sum(counts))
    shard = buffers.get(key + "r", sum(shards))
    offsets = np.cumsum([0] + counts)
    tensors = [C.as_tensor(full[a:b], "part") for a, b in zip(offsets[:-1], offsets[1:])]
    name = kind + ("_start" if async_op else "")
    if kind == "reduce_scatter":
        args = (*tensors, "sum", group, C.as_tensor(shard, "shard"))
    else:
        args = (C.as_tensor(shard, "shard"), group, *tensors)
    handle = _native.func(name)(*args)
    return C.Handle(handle, None, (full, shard, tensors), kind) if async_op else None


def _collective(kind: str, nbytes: int, group: int, size: int, buffers: _Buffers,
                async_op: bool, handle_key: str, parts: list[int] | None = None):
    """Run (or start) one collective of ``nbytes`` on ``group``; chunked past the cap. A
    bucket's reduce-scatter / allgather (``parts``) runs as the step's, one call per tensor,
    when it fits the cap."""
    from ..distributed import collectives as C

    if (parts and kind in ("reduce_scatter", "allgather")
            and sum(_floats(b) for b in parts) <= buffers.cap):
        return _bucket(kind, parts, group, size, buffers, async_op, handle_key)

    elements = _floats(nbytes)
    elements = -(-elements // size) * size  # whole blocks per rank
    chunk = max(size, buffers.cap // size * size)
    pending = []
    done = 0
    while done < elements:
        n = min(chunk, elements - done)
        asynchronous = async_op and n == elements  # chunked messages go blocking
        # a started collective keeps its buffers until its wait; blocking ones share theirs
        key = handle_key if asynchronous else "blocking"
        send = buffers.get(key + "s", n)
        if kind == "allreduce":
            h = C.allreduce(send, "sum", send, async_op=asynchronous, group=group)
        elif kind == "reduce_scatter":
            out = buffers.get(key + "r", n // size)
            h = C.reduce_scatter(send, "sum", out, async_op=asynchronous, group=group)
        elif kind == "allgather":
            out = buffers.get(key + "r", n)
            h = C.allgather(send[:n // size], n, out, async_op=asynchronous, group=group)
        else:
            out = buffers.get(key + "r", n)
            h = C.alltoall(send, out, async_op=asynchronous, group=group)
        if asynchronous:
            pending.append(h)
        done += n
    return pending[0] if pending else None


def replay(workload: Workload, cluster: Cluster, iters: int = 20, warmup: int = 3,
           max_buffer_mb: float = 64.0) -> dict[str, Any] | None:
    """Run ``iters`` timed iterations after ``warmup``; rank 0 returns the report (module
    docstring), the others None. Call on every rank of a world of ``workload.world``."""
    from mpi4py import MPI

    from .. import distributed as dist

    comm = MPI.COMM_WORLD
    if comm.size != workload.world:
        raise ValueError(f"the {workload.name} workload is for {workload.world} ranks "
                         f"(dp {workload.dp} x tp {workload.tp} x pp {workload.pp}); this job "
                         f"has {comm.size}: run it with mpirun -np {workload.world}")
    dist.get_config().reset().update({
        "tensor_parallel_size": workload.tp, "pipeline_parallel_size": workload.pp,
        "enable_data_parallel": workload.dp > 1})
    mesh = dist.get_mesh()
    groups = {"dp": (mesh.dp_group, workload.dp), "tp": (mesh.tp_group, workload.tp),
              "pp": (mesh.pp_group, workload.pp),
              "world": (dist.get_communicator().group, workload.world)}
    program = workload.programs[mesh.pp_rank]
    buffers = _Buffers(int(max_buffer_mb * 2**20))
    # each receive's buffer, allocated once: a pipeline rank holds its iteration's incoming
    # messages as the transport does (they are posted before the first action)
    inbox = {i: np.empty(max(1, -(-e.bytes // 4)), np.float32)
             for i, e in enumerate(program) if e.kind == "recv"}

    def wait(request, what):  # polling: a waiting rank keeps off the cores of the others
        from ..distributed.collectives import wait_request

        wait_request(request, what, "a peer of the replay did not get there")

    times: list[float] = []
    by_kind: dict[str, dict[str, float]] = {}
    compute = waited = 0.0
    # the cost model's durations, once (with a cluster's measured matmul shapes an event's is
    # a sum over its shapes: not work for the timed loop)
    durations = {i: compute_seconds(e, cluster) for i, e in enumerate(program)
                 if e.kind == "compute"}
    for it in range(warmup + iters):
        timed = it >= warmup
        wait(comm.Ibarrier(), "the barrier before an iteration")
        started = time.perf_counter()
        receives = {i: mesh.pp_comm.Irecv(inbox[i], source=program[i].peer, tag=program[i].tag)
                    for i in inbox}  # every receive posted first, as the transport does
        sends, handles = [], {}
        debt = 0.0  # compute not slept yet (module docstring)
        for i, e in enumerate(program):
            t0 = time.perf_counter()
            if e.kind == "compute":
                debt += durations[i]
                if debt >= _MIN_SLEEP_S:
                    time.sleep(debt)
                    debt = 0.0
                if timed:
                    compute += time.perf_counter() - t0
                continue
            if e.kind == "send":
                buf = buffers.get(f"p2p{len(sends) % 2}", -(-e.bytes // 4))
                if buf.nbytes < e.bytes:
                    buf = np.empty(-(-e.bytes // 4), np.float32)
                sends.append(mesh.pp_comm.Isend(buf, dest=e.peer, tag=e.tag))
            elif e.kind == "recv":
                wait(receives.pop(i), f"{e.what}: a pipeline message from pp rank {e.peer}")
            elif e.kind == "wait":
                h = handles.pop(e.handle)
                if h is not None:
                    h.wait()
                buffers.release(f"h{e.handle}")
            else:
                group, size = groups[e.axis]
                h = _collective(e.kind, e.bytes, group, size, buffers, e.handle >= 0,
                                f"h{e.handle}", e.parts)
                if e.handle >= 0:
                    handles[e.handle] = h
            if timed:
                dt = time.perf_counter() - t0
                waited += dt
                row = by_kind.setdefault(e.kind, {"count": 0, "bytes": 0, "seconds": 0.0})
                if e.kind != "wait":
                    row["count"] += 1
                    row["bytes"] += e.bytes
                row["seconds"] += dt
        if debt > 0:
            time.sleep(debt)
        for request in sends:
            wait(request, "a pipeline message sent")
        if timed:
            times.append(time.perf_counter() - started)
    mine = np.array(times, np.float64)
    slowest = np.empty_like(mine)
    comm.Allreduce(mine, slowest, op=MPI.MAX)  # each iteration: its slowest rank
    per_rank = comm.gather({"pp_rank": mesh.pp_rank, "compute_s": compute / max(1, iters),
                            "waited_s": waited / max(1, iters), "by_kind": by_kind}, root=0)
    if comm.rank != 0:
        return None
    median = statistics.median(slowest) if len(slowest) else 0.0
    return {"iteration_s": median, "min_s": float(min(slowest, default=0)),
            "max_s": float(max(slowest, default=0)), "iters": iters, "warmup": warmup,
            "per_rank": per_rank, "counters": dist.comm_counters()}
