"""The device mesh under mpiexec: per-axis process groups, collectives on them and their
per-group counters (workers/mesh_worker.py checks everything on each rank)."""
import re

from mpi_launch import check_mpi


def test_mesh_groups_collectives_and_counters_on_4_ranks():
    out = check_mpi("mesh_worker.py", 4, timeout=60)
    oks = re.findall(r"rank (\d+): ALL OK", out)
    assert sorted(map(int, oks)) == [0, 1, 2, 3], out


def test_mesh_with_collective_checks_on():
    # RAF_DIST_CHECK_COLLECTIVES: each mesh group cross-checks its own calls' signatures
    out = check_mpi("mesh_worker.py", 4, timeout=60, env={"RAF_DIST_CHECK_COLLECTIVES": "1"})
    oks = re.findall(r"rank (\d+): ALL OK", out)
    assert sorted(map(int, oks)) == [0, 1, 2, 3], out
