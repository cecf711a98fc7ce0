"""Uneven global batches under data parallelism on 2 real ranks (MPI): 7 rows as 4 + 3 train
as one process on the 7 rows (loss and parameters), plain data parallelism, ZeRO-2 and ZeRO-3
(level 1 passed too when run by hand), and a rank with no rows raises on every rank. The
worker: workers/uneven_batch.py (one mpiexec run, ~30 s on 2 cores)."""
from mpi_launch import assert_ranks_ok, check_mpi


def test_uneven_batches_match_one_process():
    out = check_mpi("uneven_batch.py", 2, "0,2,3", timeout=420)
    assert_ranks_ok(out, 2)
