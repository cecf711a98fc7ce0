"""The pp x dp x tp mesh: coordinates, size checks, and get_mesh in a world of one.
Multi-rank groups are tested under mpiexec in tests/distributed/test_mesh.py."""
import itertools
import types

import numpy as np
import pytest

from raf_dist import distributed as dist
from raf_dist.distributed.mesh import ProcessMesh, check_mesh, mesh_coordinates
from raf_dist.layout import ParallelLayout


def test_coordinates_world8_pp2_dp2_tp2_follow_the_formula():
    world, tp, pp, dp = 8, 2, 2, 2
    coords = [mesh_coordinates(r, world, tp, pp) for r in range(world)]
    for rank, (pp_i, dp_i, tp_i) in enumerate(coords):
        assert rank == (pp_i * dp + dp_i) * tp + tp_i
        assert 0 <= pp_i < pp and 0 <= dp_i < dp and 0 <= tp_i < tp
    # a bijection onto the grid, tp innermost
    assert sorted(coords) == list(itertools.product(range(pp), range(dp), range(tp)))
    assert coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (6, 3, 1), (12, 2, 3), (8, 1, 8), (8, 8, 1)])
def test_coordinates_are_a_bijection(world, tp, pp):
    dp = world // (tp * pp)
    coords = {mesh_coordinates(r, world, tp, pp) for r in range(world)}
    assert coords == set(itertools.product(range(pp), range(dp), range(tp)))


def test_coordinates_reject_bad_rank():
    with pytest.raises(ValueError, match="rank"):
        mesh_coordinates(8, 8, 2, 2)


def test_check_mesh_ok():
    assert check_mesh(8, 2, 2, True) == 2
    assert check_mesh(4, 2, 2, False) == 1
    assert check_mesh(4, 4, 1, False) == 1
    assert check_mesh(1, 1, 1, False) == 1
    assert check_mesh(6, 3, 1, True) == 2


def test_check_mesh_world_not_divisible_names_sizes_and_fix():
    with pytest.raises(ValueError) as err:
        check_mesh(6, 4, 1, True)
    message = str(err.value)
    assert "6 ranks" in message and "tensor_parallel_size=4" in message
    assert "pipeline_parallel_size=1" in message and "-np 4, 8, 12" in message
    with pytest.raises(ValueError, match="-np 4\\b"):  # without data parallelism only tp*pp works
        check_mesh(6, 2, 2, False)


def test_check_mesh_dp_requires_data_parallel():
    with pytest.raises(ValueError) as err:
        check_mesh(8, 2, 2, False)
    message = str(err.value)
    assert "dist.get_config().enable_data_parallel = True" in message
    assert "tensor_parallel_size * pipeline_parallel_size == world" in message


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_check_mesh_rejects_bad_sizes(bad):
    with pytest.raises(ValueError):
        check_mesh(4, bad, 1, True)


def test_axis_ranks_world8():
    layout = ParallelLayout.build(8, 5, tp=2, pp=2, enable_data_parallel=True)
    mesh = ProcessMesh(layout, {"tp": 1, "dp": 2, "pp": 3})
    assert (mesh.rank, mesh.world_size, mesh.tp_size, mesh.dp_size, mesh.pp_size, mesh.tp_rank,
            mesh.dp_rank, mesh.pp_rank) == (5, 8, 2, 2, 2, 1, 0, 1)
    assert (mesh.tp_group, mesh.dp_group, mesh.pp_group, mesh.cp_group) == (1, 2, 3, -1)
    assert mesh.axis_ranks("tp") == [4, 5]
    assert mesh.axis_ranks("dp") == [5, 7]
    assert mesh.axis_ranks("pp") == [1, 5]
    with pytest.raises(ValueError, match="axis"):
        mesh.axis_ranks("ep")
    assert len(repr(mesh)) < 100 and "tp 1/2" in repr(mesh)


def test_get_mesh_world_of_one_reuses_the_world_group():
    comm = dist.get_communicator()
    config = types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                   enable_data_parallel=False)
    mesh = dist.get_mesh(config)
    assert (mesh.rank, mesh.world_size, mesh.tp_rank, mesh.dp_rank, mesh.pp_rank) == (0, 1, 0, 0, 0)
    assert mesh.tp_group == mesh.dp_group == mesh.pp_group == comm.group
    assert dist.get_mesh(config) is mesh
    config.enable_data_parallel = True  # same sizes: the cached mesh, no new groups
    assert dist.get_mesh(config) is mesh
    dist.reset_comm_counters()
    dist.allreduce(np.ones(3, np.float32), group=mesh.tp_group)
    assert dist.comm_counters(mesh.tp_group)["allreduce"]["calls"] == 1
    dist.reset_comm_counters(mesh.tp_group)
    assert dist.comm_counters(mesh.tp_group)["allreduce"]["calls"] == 0
    assert dist.comm_counters()["allreduce"]["calls"] == 1  # the total keeps it


def test_get_mesh_checks_before_building():
    config = types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                                   enable_data_parallel=True)
    with pytest.raises(ValueError, match="multiple of"):
        dist.get_mesh(config)
