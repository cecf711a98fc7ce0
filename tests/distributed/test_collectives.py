"""Distributed tier for the collective runtime: real mpiexec runs, each under a hard timeout.

Start here: workers/ holds the per-rank programs; each checks its own results against numpy
and prints 'ALL OK'.
"""
import json
import re

import pytest

from mpi_launch import ROOT, assert_ranks_ok, check_mpi, localhost_hostfile, run_mpi


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_collective_matrix_against_numpy(nprocs):
    assert_ranks_ok(check_mpi("ccl_matrix.py", nprocs), nprocs)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_async_overlap_lifetime_and_counters(nprocs):
    assert_ranks_ok(check_mpi("ccl_async.py", nprocs), nprocs)


def test_a_bucket_of_tensors_reduce_scattered_and_gathered():
    assert_ranks_ok(check_mpi("ccl_parts.py", 3), 3)


def test_collectives_from_compiled_relax():
    assert_ranks_ok(check_mpi("ccl_relax.py", 2), 2)


def _infos(out):
    # ranks share one stdout, so lines may interleave: pick out each JSON object
    return sorted((json.loads(m) for m in re.findall(r"INFO (\{[^}]*\})", out)),
                  key=lambda info: info["rank"])


def test_communicator_fields_under_mpiexec():
    infos = _infos(check_mpi("ccl_info.py", 3))
    assert [i["rank"] for i in infos] == [0, 1, 2]
    assert all(i["size"] == 3 and i["local_size"] == 3 for i in infos)
    assert [i["local_rank"] for i in infos] == [0, 1, 2]


def test_hostfile_with_localhost_slots():
    hostfile = localhost_hostfile()  # MPICH's or Open MPI's format, for the launcher in use
    infos = _infos(check_mpi("ccl_info.py", 4, launcher_args=["--hostfile", str(hostfile)]))
    assert [i["local_rank"] for i in infos] == [0, 1, 2, 3]
    assert {i["local_size"] for i in infos} == {4}


@pytest.mark.parametrize("mode", ["count", "kind", "splits"])
def test_mismatch_check_names_ranks_and_signatures(mode):
    out = check_mpi("ccl_mismatch.py", 2, mode, env={"RAF_DIST_CHECK_COLLECTIVES": "1"},
                    timeout=60)
    if mode == "splits":  # both ranks raise; the one whose expectation is wrong says which
        reports = dict(re.findall(r"rank (\d) MISMATCH: (.*?receive split i\.)", out, flags=re.S))
        assert sorted(reports) == ["0", "1"], out
        assert "rank 1 sends 2 elements to rank 0, which expects 3" in reports["0"], out
        assert "the alltoallv splits disagree on another rank" in reports["1"], out
        return
    # one report per rank; ranks share stdout, so find each report rather than split lines
    reports = dict(re.findall(r"rank (\d) MISMATCH: (.*?same order\.)", out, flags=re.S))
    assert sorted(reports) == ["0", "1"], out  # both ranks raised
    for report in reports.values():
        assert "rank 0: allreduce(sum, float32" in report and "call #1" in report
        if mode == "count":
            assert "send 10, recv 10" in report and "send 11, recv 11" in report
        else:
            assert "rank 1: allgather(float32, send 4, recv 8" in report


def test_failing_rank_ends_the_job_quickly():
    code, out, seconds = run_mpi("ccl_fail.py", 3, timeout=60)
    assert code != 0, out
    assert seconds < 30, f"job took {seconds:.1f} s to end"
    assert "[raf_dist] rank 1/3" in out and "deliberate failure on rank 1" in out


def test_a_caught_timeout_exits_without_waiting_for_the_stuck_thread():
    code, out, seconds = run_mpi("ccl_timeout_exit.py", 2, timeout=90,
                                 env={"RAF_DIST_COLLECTIVE_TIMEOUT_S": "2",
                                      "RAF_DIST_WATCHDOG_GRACE_S": "1"})
    assert code != 0 and seconds < 40, (code, seconds, out)
    assert "rank 0: caught TimeoutError: allreduce of 4/4 float32 elements did not complete" in out
    assert "[raf_dist] rank 0/2: exit status 1: the job failed" in out, out
    assert "rank 1/2 on" in out and "ending the job: rank 0/2 on" in out, out


def test_collective_demo_runs():
    out = check_mpi(ROOT / "scripts" / "distributed" / "collective_demo.py", 2)
    assert "OK: every result matches numpy" in out
