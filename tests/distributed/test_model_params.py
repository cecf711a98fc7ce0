"""Distributed tier for parameters as real models have them: a model whose head is its token
embedding (GPT-2's tying) trains on 2 ranks under plain data parallelism and ZeRO-3 exactly as
one process on the global batch (workers/tied_train.py; one mpiexec run checks both levels);
a NaN on one rank with nonfinite="skip" skips the update on every rank
(workers/nonfinite_worker.py)."""
from mpi_launch import assert_ranks_ok, check_mpi


def test_tied_weights_under_data_parallel_and_zero3_match_one_process():
    out = check_mpi("tied_train.py", 2, "0,3", timeout=360)
    assert_ranks_ok(out, 2)


def test_a_nan_on_one_rank_skips_the_update_on_every_rank():
    """nonfinite="skip" under plain data parallelism and ZeRO-2 (ShardZeRO's guard): the NaN
    in the last rank's batch makes every rank skip that step's update together."""
    out = check_mpi("nonfinite_worker.py", 2, "0,2", timeout=300)
    assert_ranks_ok(out, 2, "SKIP OK")
