"""Ranks that build different Trainers end with the difference named on every rank, before any
other collective (workers/agree_worker.py) — a rank without data parallelism among ranks with
it included — and a rank that builds no Trainer while the others do is named by the agreement
barrier's timeout instead of leaving them waiting forever."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi, run_mpi


@pytest.mark.parametrize("case,field", [("loss", "in loss"),
                                        ("zero", "in config.zero_opt_level"),
                                        ("device", "in device"),
                                        ("data_parallel", "in config.enable_data_parallel")])
def test_different_trainers_are_refused_on_every_rank(case, field):
    # the default barrier timeout (an hour): a refusal must come from the agreement itself
    out = check_mpi("agree_worker.py", 2, case, timeout=120)
    assert_ranks_ok(out, 2, "refused:")
    assert out.count("refused:") == 2 and out.count(field) == 2, out


def test_ranks_that_all_ask_for_no_parallelism_train_independently():
    out = check_mpi("agree_worker.py", 2, "independent", timeout=120)
    assert_ranks_ok(out, 2, "built a Trainer (spmd=False)")


def test_a_local_trainer_on_one_rank_trains_alone():
    out = check_mpi("agree_worker.py", 2, "one_rank_local", timeout=120,
                    env={"RAF_DIST_BARRIER_TIMEOUT_S": "5"})
    assert "rank 0: built a Trainer (spmd=False)" in out, out


def test_a_rank_without_a_trainer_is_named_not_waited_for():
    code, out, seconds = run_mpi("agree_worker.py", 2, "one_rank", timeout=120,
                                 env={"RAF_DIST_BARRIER_TIMEOUT_S": "5"})
    assert code != 0, out
    assert "agreement at Trainer construction" in out and "rank(s) 1 never arrived" in out, out
    assert seconds < 90, seconds
