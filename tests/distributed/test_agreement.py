"""Ranks that build different Trainers end with the difference named on every rank, before any
other collective (workers/agree_worker.py), and a rank that builds a local Trainer while the
others build a data-parallel one is named by the agreement barrier's timeout instead of
leaving them waiting forever."""
import pytest

from mpi_launch import check_mpi, run_mpi


@pytest.mark.parametrize("case,field", [("loss", "in loss"),
                                        ("zero", "in config.zero_opt_level"),
                                        ("device", "in device")])
def test_different_trainers_are_refused_on_every_rank(case, field):
    out = check_mpi("agree_worker.py", 2, case, timeout=120)
    assert out.count("refused:") == 2 and out.count(field) == 2, out


def test_a_rank_without_data_parallelism_is_named_not_waited_for():
    code, out, seconds = run_mpi("agree_worker.py", 2, "data_parallel", timeout=120,
                                 env={"RAF_DIST_BARRIER_TIMEOUT_S": "5"})
    assert code != 0, out
    assert "agreement at Trainer construction" in out and "rank(s) 1 never arrived" in out, out
    assert seconds < 90, seconds
