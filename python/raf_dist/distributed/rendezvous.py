"""Forming one MPI world from workers that ``raf_dist.run`` started independently.

Under ``mpirun`` every rank is born in one MPI world. Under the launcher each worker is started
alone (as a one-process ``mpiexec -n 1`` job: measured with the ``mpich`` wheel, plain
singletons fail in ``MPI_Comm_accept``/``connect`` because they get the same process ids), so
``get_communicator()`` joins the others here, through the rendezvous store:

1. every worker checks in under its ``RANK`` and waits (``--rdzv-timeout``) until all
   ``WORLD_SIZE`` have, so that a worker that never comes is named before any MPI call that
   could block forever;
2. the world grows by merging neighbouring blocks of ranks, doubling each round: in round r
   the block of ranks [2k·2^r, (2k+1)·2^r) opens an MPI port, publishes its name in the store,
   and accepts the block after it, which connects; ``Intercomm.Merge`` (the lower block
   first) keeps rank order = ``RANK``. log2(N) rounds of accept/connect + merge, each
   collective over the blocks involved.

Keys live under ``attempt/<RAF_DIST_RESTART_COUNT>/`` so a restarted attempt never reads the
last one's port names. The NCCL unique id needs nothing more: the native runtime broadcasts
it over the group's MPI communicator, which is this world.
"""
import dataclasses
import json
import logging
import os
import socket
from typing import Optional, Tuple

from .store import StoreClient

logger = logging.getLogger("raf_dist")

#: set by raf_dist.run for its workers (with the torchrun names); its presence means "launched"
TOKEN_ENV = "RAF_DIST_RDZV_TOKEN"
TIMEOUT_ENV = "RAF_DIST_RDZV_TIMEOUT"
RESTART_ENV = "RAF_DIST_RESTART_COUNT"


class RendezvousError(RuntimeError):
    """The workers of a launched job could not form their world."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the launcher put this worker (the torchrun environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int  # GROUP_RANK
    master_addr: str
    master_port: int
    token: str
    restart_count: int
    timeout: float


def placement_from_environment() -> Optional[Placement]:
    """The launcher's placement of this process, or None when raf_dist.run did not start it."""
    env = os.environ
    if TOKEN_ENV not in env:
        return None
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", RESTART_ENV, TIMEOUT_ENV)
    missing = [name for name in names if name not in env]
    if missing:
        raise RendezvousError(f"{TOKEN_ENV} is set but {', '.join(missing)} are not: start "
                              f"workers with `python -m raf_dist.run`, or unset {TOKEN_ENV}")
    try:
        placement = Placement(
            int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
            int(env["LOCAL_WORLD_SIZE"]), int(env["GROUP_RANK"]), env["MASTER_ADDR"],
            int(env["MASTER_PORT"]), env[TOKEN_ENV], int(env[RESTART_ENV]),
            float(env[TIMEOUT_ENV]))
    except ValueError as err:
        raise RendezvousError(f"a launcher variable is not a number ({err}); they are set by "
                              f"`python -m raf_dist.run`") from None
    if not 0 <= placement.rank < placement.world_size:
        raise RendezvousError(f"RANK={placement.rank} is outside WORLD_SIZE="
                              f"{placement.world_size}")
    return placement


def _join_store(store: StoreClient, placement: Placement, prefix: str) -> None:
    """Check in and wait for every rank; name the missing ones on timeout."""
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                     "node": placement.node_rank}).encode()
    holder = store.compare_set(f"{prefix}worker/{placement.rank}", b"", me)
    if holder != me:
        raise RendezvousError(f"rank {placement.rank} joined twice in attempt "
                              f"{placement.restart_count} (the other: {holder.decode()}): two "
                              f"launchers were given the same --node-rank")
    if store.add(f"{prefix}joined", 1) == placement.world_size:
        store.set(f"{prefix}all_joined", b"1")
    try:
        store.get(f"{prefix}all_joined", timeout=placement.timeout)
    except TimeoutError:
        keys = [f"{prefix}worker/{r}" for r in range(placement.world_size)]
        missing = [r for r, present in enumerate(store.check(keys)) if not present]
        raise RendezvousError(
            f"rank {placement.rank}: ranks {missing} of {placement.world_size} did not join "
            f"within {placement.timeout:.0f} s (--rdzv-timeout): their node's launcher is "
            f"missing, or the worker did not reach raf_dist's get_communicator()") from None


def _merge_blocks(store: StoreClient, placement: Placement, prefix: str):
    from mpi4py import MPI

    comm, rank, size = MPI.COMM_SELF, placement.rank, placement.world_size
    block, round_ = 1, 0
    while block < size:
        index = rank // block
        leader = index * block
        key = f"{prefix}port/{round_}/{index - index % 2}"
        if index % 2 == 0 and leader + block < size:  # accepts the next block
            port = MPI.Open_port() if rank == leader else None
            if rank == leader:
                store.set(key, port.encode())
            inter = comm.Accept(port, root=0)
            merged = inter.Merge(high=False)
            if rank == leader:
                MPI.Close_port(port)
        elif index % 2 == 1:  # connects to the block before it
            port = store.get(key, timeout=placement.timeout).decode() if rank == leader else None
            inter = comm.Connect(port, root=0)
            merged = inter.Merge(high=True)
        else:  # the last block, without a partner this round
            block, round_ = block * 2, round_ + 1
            continue
        inter.Disconnect()
        if comm is not MPI.COMM_SELF:
            comm.Free()
        comm = merged
        block, round_ = block * 2, round_ + 1
    if comm.Get_rank() != rank or comm.Get_size() != size:  # the merge order is the contract
        raise RendezvousError(f"the merged MPI world gave rank {comm.Get_rank()} of "
                              f"{comm.Get_size()} to RANK={rank} of WORLD_SIZE={size}")
    return comm


def join_world(placement: Placement) -> Tuple[object, Optional[str]]:
    """This worker's MPI world (an mpi4py intracommunicator, rank = ``RANK``), and the address
    at which this host reaches node 0 (None in a world of one)."""
    from mpi4py import MPI

    if placement.world_size == 1:
        return MPI.COMM_WORLD, None
    store = StoreClient(placement.master_addr, placement.master_port, placement.token,
                        connect_timeout=placement.timeout, timeout=placement.timeout)
    try:
        prefix = f"attempt/{placement.restart_count}/"
        _join_store(store, placement, prefix)
        world = _merge_blocks(store, placement, prefix)
        logger.info("rank %d/%d: MPI world formed through the rendezvous store at %s:%d",
                    placement.rank, placement.world_size, placement.master_addr,
                    placement.master_port)
        return world, store.local_address
    finally:
        store.close()
