"""The step's rows across the ranks: every rank's count exchanged before a step (under the
collective timeout) and checked (raised on every rank together)."""
from typing import Any, List, Sequence, Tuple

import numpy as np

from ..distributed.collectives import wait_request
from ..distributed.communicator import raised_on_every_rank


def allgather_rows(mpi_comm: Any, rows: int) -> List[int]:
    """Every rank's row count (an mpi4py communicator's Iallgather). It polls, sleeping
    after the first hundred tests: a rank still compiling the step for a new size must not
    have its core taken by the others' busy-waiting (MPICH's blocking calls spin)."""
    return allgather_rows_and_flags(mpi_comm, rows, 0)[0]


def allgather_rows_and_flags(mpi_comm: Any, rows: int,
                             flag: int) -> Tuple[List[int], List[int]]:
    """(every rank's row count, every rank's ``flag``): ``allgather_rows`` carrying one more
    integer per rank (a verdict each rank reached alone, e.g. that its batch has a bad id,
    so every rank raises together instead of one leaving the others in a collective)."""
    rows_per_rank, flags = zip(*allgather_ints(mpi_comm, [rows, flag],
                                               "the exchange of every rank's batch rows "
                                               "before the step"))
    return list(rows_per_rank), list(flags)


def allgather_ints(mpi_comm: Any, values: Sequence[int], what: str) -> List[List[int]]:
    """Every rank's ``values`` (as many on every rank; int64), by rank: an Iallgather
    waited on under the collective timeout (``what`` names it in the error)."""
    size = mpi_comm.Get_size()
    send = np.array(values, np.int64)
    received = np.zeros(size * send.size, np.int64)
    # a rank that never comes must not hang the others
    wait_request(mpi_comm.Iallgather(send, received), what,
                 "a peer rank has probably died, stalled or is running a different program")
    return [[int(v) for v in row] for row in received.reshape(size, send.size)]


def check_rows_per_rank(rows_per_rank: Sequence[int], rank: int) -> None:
    """Every rank needs at least one row (a step of zero rows has no mean); raised on every
    rank together, since every rank sees the same counts."""
    empty = [r for r, rows in enumerate(rows_per_rank) if rows == 0]
    if empty:
        raise raised_on_every_rank(ValueError(
            f"ranks {empty} got no rows in this step (rows per rank: {list(rows_per_rank)}; "
            f"this is rank {rank}): every rank needs at least one row of the global batch. "
            "Use a global batch of at least as many rows as ranks, e.g. "
            "raf_dist.data.shard(..., drop_last=True) to drop a shorter tail"))
