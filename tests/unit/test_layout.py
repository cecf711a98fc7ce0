"""raf_dist.layout: the one sharding rule (pinned to the native runtime's), the StateLayout's
bucket-major packing, and the import layering of DESIGN.md section 2 (import-linter)."""
import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raf_dist import _native
from raf_dist.layout import (ParallelLayout, local_shard, row_state_shape, shard_size, slice_range,
                             state_layout)

SPECS = [((3, 4), "float32"), ((5,), "float32"), ((2, 2), "float32")]
NAMES = ["a", "b", "c"]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_the_sharding_rule_is_the_native_runtimes(world):
    count, valid = _native.func("shard_count"), _native.func("valid_count")
    for numel in [0, 1, 2, 5, 12, 13, 64, 1001]:
        assert shard_size(numel, world) == count(numel, world)
        for rank in range(world):
            begin, end = slice_range(numel, world, rank)
            assert end - begin == valid(numel, world, rank), (numel, world, rank)
        # the ranks' ranges tile the tensor exactly once, in rank order
        ranges = [slice_range(numel, world, r) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_local_shard_pads_with_zeros():
    array = np.arange(1, 6, dtype=np.float32)
    assert local_shard(array, 2, 0).tolist() == [1, 2, 3]
    assert local_shard(array, 2, 1).tolist() == [4, 5, 0]
    assert local_shard(array, 4, 3).tolist() == [0, 0]


def _by_key(layout, full):
    return {(p, s): layout.shard(full[(p, s)]) if layout.states_sharded else full[(p, s)]
            for p, s in layout.state_keys()}


def test_zero_states_are_bucket_major_shards_and_unpack_inverts_pack():
    layout = state_layout(NAMES, SPECS, ["m", "v"], zero_level=1, dp_size=2, dp_rank=1,
                          buckets=[(2, 1), (0,)])
    # arguments: bucket 0 (c, b) m, bucket 0 v, bucket 1 (a) m, bucket 1 v
    buffers = layout.state_buffers()
    assert [(b.bucket, b.state, b.params, b.offsets, b.numel) for b in buffers] == [
        (0, "m", (2, 1), (0, 2), 5), (0, "v", (2, 1), (0, 2), 5),
        (1, "m", (0,), (0,), 6), (1, "v", (0,), (0,), 6)]
    rng = np.random.default_rng(0)
    full = {(p, s): rng.standard_normal(shape).astype("float32")
            for p, (shape, _) in zip(NAMES, SPECS) for s in ("m", "v")}
    packed = layout.pack_states(_by_key(layout, full))
    assert [a.shape for a in packed] == [(5,), (5,), (6,), (6,)]
    # rank 1's shard of c (4 elements: [2, 4)) then of b (5 elements: [3, 5) + padding)
    assert packed[0].tolist() == (full[("c", "m")].reshape(-1)[2:].tolist()
                                  + full[("b", "m")][3:].tolist() + [0.0])
    unpacked = layout.unpack_states(packed)
    for key, value in _by_key(layout, full).items():
        assert np.array_equal(unpacked[key], value), key
    assert [a.shape for a in layout.zero_states()] == [(5,), (5,), (6,), (6,)]


def test_level0_states_are_whole_and_in_parameter_order():
    layout = state_layout(NAMES, SPECS, ["m"], zero_level=0, dp_size=4, dp_rank=3)
    assert (layout.dp_size, layout.dp_rank, layout.states_sharded) == (1, 0, False)
    full = {(p, "m"): np.full(shape, i, "float32") for i, (p, (shape, _)) in
            enumerate(zip(NAMES, SPECS))}
    packed = layout.pack_states(full)
    assert [a.shape for a in packed] == [(3, 4), (5,), (2, 2)]
    assert all(np.array_equal(layout.unpack_states(packed)[k], v) for k, v in full.items())


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_bytes_follow_design_section_3(level):
    n, psi = 4, 12 + 5 + 4
    shards = shard_size(12, n) + shard_size(5, n) + shard_size(4, n)  # 3 + 2 + 1
    layout = state_layout(NAMES, SPECS, ["m", "v"], level, n, 0, [(0, 1, 2)])
    assert layout.param_bytes() == 4 * (shards if level == 3 else psi)
    assert layout.grad_bytes() == 4 * (shards if level >= 2 else psi)
    assert layout.state_bytes() == 2 * 4 * (shards if level else psi)
    assert layout.held_param_shape(0) == ((3,) if level == 3 else (3, 4))


def test_a_sparsely_updated_table_holds_no_gradient():
    """A table updated on its looked-up rows (``sparse``) forms no whole gradient: its bytes
    leave grad_bytes at every level, the others' stay (a local one whole, the rest shards)."""
    n = 4
    plain = state_layout(NAMES, SPECS, ["m"], 0, n, 0, [(0, 1, 2)])
    sparse = state_layout(NAMES, SPECS, ["m"], 0, n, 0, [(0, 1, 2)], sparse=[0])
    assert plain.grad_bytes() - sparse.grad_bytes() == 4 * 12
    zero2 = state_layout(NAMES, SPECS, ["m"], 2, n, 0, [(1, 2)], local=[0], sparse=[0])
    assert zero2.grad_bytes() == 4 * (shard_size(5, n) + shard_size(4, n))
    assert state_layout(NAMES, SPECS, ["m"], 2, n, 0, [(1, 2)], local=[0]).grad_bytes() \
        == 4 * (12 + shard_size(5, n) + shard_size(4, n))


def test_row_states_hold_one_value_per_row():
    """Row-wise Adagrad's accumulator: (rows, 1) of a 2-D parameter, the parameter's own shape
    of a 1-D one; the other states keep their parameter's shape; fresh values as asked."""
    layout = state_layout(NAMES, SPECS, ["sum", "m"], row_states=["sum"])
    assert [layout.state_shape(i, "sum") for i in range(3)] == [(3, 1), (5,), (2, 1)]
    assert [layout.state_shape(i, "m") for i in range(3)] == [(3, 4), (5,), (2, 2)]
    fresh = list(layout.zero_states([{"sum": 0.5}, {"sum": 0.5}, {"sum": 0.25}]))  # by parameter
    assert [(a.shape, float(a.flat[0])) for a in fresh] == [
        ((3, 1), 0.5), ((3, 4), 0.0), ((5,), 0.5), ((5,), 0.0), ((2, 1), 0.25), ((2, 2), 0.0)]
    assert layout.state_bytes() == 4 * ((3 + 5 + 2) + (12 + 5 + 4))
    assert all(np.array_equal(layout.unpack_states(fresh)[k], v)
               for k, v in zip(layout.state_keys(), fresh))
    assert row_state_shape((7, 2, 3, 3)) == (7, 1, 1, 1) and row_state_shape(()) == ()
    with pytest.raises(ValueError, match="one value per row"):  # ZeRO's shards cut rows
        state_layout(NAMES, SPECS, ["sum"], 1, 2, 0, [(0, 1, 2)], row_states=["sum"])


def test_local_parameters_are_held_whole_beside_the_buckets():
    """A sharded embedding table (``local``) under ZeRO-3: whole parameter and states, in no
    bucket, its state buffers after the buckets' flat ones; the rest sharded as ever."""
    n = 4
    layout = state_layout(NAMES, SPECS, ["m"], 3, n, 1, [(2, 1)], local=[0])
    assert layout.held_param_shape(0) == (3, 4) and layout.held_param_shape(1) == (2,)
    assert [(b.params, b.numel) for b in layout.state_buffers()] == [((2, 1), 1 + 2), ((0,), 12)]
    full = {(p, "m"): np.arange(np.prod(shape), dtype="float32").reshape(shape)
            for p, (shape, _) in zip(NAMES, SPECS)}
    held = {k: layout.shard_param(NAMES.index(k[0]), v) for k, v in full.items()}
    packed = layout.pack_states(held)
    assert [a.shape for a in packed] == [(3,), (3, 4)]
    assert all(np.array_equal(layout.unpack_states(packed)[k], v) for k, v in held.items())
    assert layout.param_bytes() == 4 * (12 + shard_size(5, n) + shard_size(4, n))
    assert [a.shape for a in layout.zero_states()] == [(3,), (3, 4)]
    with pytest.raises(ValueError, match="every parameter index once"):
        state_layout(NAMES, SPECS, ["m"], 1, n, 0, [(2, 1)])  # parameter 0 nowhere


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="every parameter index once"):
        state_layout(NAMES, SPECS, ["m"], 1, 2, 0, [(0, 1)])
    with pytest.raises(ValueError, match="zero_level must be"):
        state_layout(NAMES, SPECS, ["m"], 4, 2, 0, [(0, 1, 2)])
    with pytest.raises(ValueError, match="is not a rank"):
        state_layout(NAMES, SPECS, ["m"], 1, 2, 2, [(0, 1, 2)])


def test_mesh_coordinates_cover_the_world_once():
    for tp, pp, dp in itertools.product([1, 2], [1, 2], [1, 3]):
        world = tp * pp * dp
        seen = {(m.pp_rank, m.dp_rank, m.tp_rank) for m in
                (ParallelLayout.build(world, r, tp=tp, pp=pp, enable_data_parallel=True)
                 for r in range(world))}
        assert len(seen) == world
    assert ParallelLayout.single() == ParallelLayout.build(1, 0)


def test_the_layer_contract_holds():
    """DESIGN.md section 2's layers and no import cycles (pyproject.toml's import-linter
    contracts): a module importing upward fails here, naming the import."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is a test dependency (setup.py's test extra)"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([lint], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 kept, 0 broken" in done.stdout, done.stdout[-2000:]
