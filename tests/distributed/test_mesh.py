"""The device mesh under mpiexec: per-axis process groups, collectives on them and their
per-group counters (workers/mesh_worker.py checks everything on each rank)."""
from mpi_launch import assert_ranks_ok, check_mpi


def test_mesh_groups_collectives_and_counters_on_4_ranks():
    assert_ranks_ok(check_mpi("mesh_worker.py", 4, timeout=60), 4)


def test_mesh_with_collective_checks_on():
    # RAF_DIST_CHECK_COLLECTIVES: each mesh group cross-checks its own calls' signatures
    out = check_mpi("mesh_worker.py", 4, timeout=60, env={"RAF_DIST_CHECK_COLLECTIVES": "1"})
    assert_ranks_ok(out, 4)
