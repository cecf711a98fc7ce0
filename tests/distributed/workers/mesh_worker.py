"""The device mesh on 4 ranks as dp 2 x tp 2: coordinates, per-axis groups (membership and
order), collectives on each group, and per-group bus-byte counters. Prints 'rank N: ALL OK'."""
import types

import numpy as np

from raf_dist import _native
from raf_dist import distributed as dist
from raf_dist.distributed.mesh import mesh_coordinates

ELEMS = 1000  # float64: 8000 bytes per allreduce


def check_axis(mesh, axis, counted):
    group = getattr(mesh, f"{axis}_group")
    size, position = getattr(mesh, f"{axis}_size"), getattr(mesh, f"{axis}_rank")
    members = mesh.axis_ranks(axis)
    assert members[position] == mesh.rank, (axis, members)
    assert _native.func("group_size")(group) == size and _native.func("group_rank")(group) == position
    assert getattr(mesh, f"{axis}_comm").allgather(mesh.rank) == members, axis
    total = dist.allreduce(np.full(ELEMS, mesh.rank, np.float64), group=group)
    np.testing.assert_array_equal(total, sum(members))
    # group rank order is world rank order: the gathered shards come back in axis_ranks order
    gathered = dist.allgather(np.array([mesh.rank], np.int64), group=group)
    assert gathered.tolist() == members, (axis, gathered)
    counted[group] = counted.get(group, 0.0) + 2 * (size - 1) / size * ELEMS * 8


def main():
    comm = dist.get_communicator()
    rank, world = comm.rank, comm.size
    assert world == 4, world
    config = dist.get_config()
    config.enable_data_parallel = True
    config.tensor_parallel_size = 2

    mesh = dist.get_mesh()
    assert (mesh.rank, mesh.world_size) == (rank, world)
    assert (mesh.pp_size, mesh.dp_size, mesh.tp_size) == (1, 2, 2)
    assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == (0, rank // 2, rank % 2)
    assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == mesh_coordinates(rank, world, 2, 1)
    assert mesh.axis_ranks("tp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert mesh.axis_ranks("dp") == [rank % 2, rank % 2 + 2]
    assert mesh.axis_ranks("pp") == [rank]
    ids = (mesh.tp_group, mesh.dp_group, mesh.pp_group)
    assert len(set(ids) | {comm.group}) == 4, ids  # three new groups, none the world's
    assert all(other == ids for other in comm.mpi_comm.allgather(ids)), "ids differ across ranks"
    assert dist.get_mesh() is mesh  # cached: no new groups

    dist.reset_comm_counters()
    counted = {}
    for axis in ("tp", "dp"):
        check_axis(mesh, axis, counted)
    for group in (mesh.tp_group, mesh.dp_group):
        c = dist.comm_counters(group)
        assert c["allreduce"]["calls"] == 1 and c["allgather"]["calls"] == 1, (group, c)
        assert abs(c["allreduce"]["bus_bytes"] - counted[group]) < 1e-9, (group, c, counted)
        assert c["allgather"]["bus_bytes"] == 0.5 * 2 * 8, c  # (N-1)/N * S, S = 2 int64
    for group in (mesh.pp_group, comm.group):  # nothing ran on these
        c = dist.comm_counters(group)
        assert all(v["calls"] == 0 and v["bus_bytes"] == 0 for v in c.values()), (group, c)
    total = dist.comm_counters()
    assert total["allreduce"]["calls"] == 2
    assert abs(total["allreduce"]["bus_bytes"] - sum(counted.values())) < 1e-9, total
    dist.reset_comm_counters()
    assert dist.comm_counters(mesh.tp_group)["allreduce"]["calls"] == 0  # reset all resets groups

    # a pp axis of size 1 is a group of one: collectives are identities, no bus bytes
    np.testing.assert_array_equal(dist.allreduce(np.full(3, rank, np.float64), group=mesh.pp_group),
                                  rank)
    assert dist.comm_counters(mesh.pp_group)["allreduce"] == {"calls": 1, "bus_bytes": 0.0}

    # an axis spanning the world reuses the world group
    whole = dist.get_mesh(types.SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=1,
                                                enable_data_parallel=False))
    assert whole.tp_group == comm.group and whole.tp_comm is comm.mpi_comm
    assert (whole.tp_rank, whole.dp_size, whole.pp_size) == (rank, 1, 1)
    assert whole.dp_group not in ids + (comm.group,)

    # a bad size fails the same way on every rank, before any collective
    config.tensor_parallel_size = 3
    try:
        dist.get_mesh()
    except ValueError as err:
        assert "multiple of" in str(err) and "-np 3" in str(err), err
    else:
        raise AssertionError("tensor_parallel_size=3 on 4 ranks did not raise")
    config.reset()

    dist.barrier()
    print(f"rank {rank}: ALL OK", flush=True)


if __name__ == "__main__":
    main()
