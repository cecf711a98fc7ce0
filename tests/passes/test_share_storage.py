"""ShareStorageAcrossDtypes (raf_dist.compiler.share_storage): after TVM's planner, a block
freed by a tensor of one dtype is reused by a later tensor of another; a tensor still
reachable (through an alias) keeps its block; the step computes the same values."""
import numpy as np
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.compiler.memory import planned_bytes
from raf_dist.compiler.share_storage import (ALIGNMENT, ShareStorageAcrossDtypes, assign_offsets,
                                             assign_shared_objects)

#: TVM's plan of a float32 tensor ``a`` (1024 B) written by f; each test's function continues it
HEADER = """
@I.ir_module
class Planned:
    @R.function(pure=False)
    def main(x: R.Tensor((256,), "float32"), out: R.Tensor((256,), "bfloat16")):
        s0 = R.memory.alloc_storage(R.shape([1024]), 0, "global", "float32")
        a = R.memory.alloc_tensor(s0, 0, R.shape([256]), "float32")
        _0 = R.call_packed("f", x, a, sinfo_args=[R.Tuple()])
"""

SOURCE = HEADER + """        a2 = a
        s1 = R.memory.alloc_storage(R.shape([512]), 0, "global", "bfloat16")
        b = R.memory.alloc_tensor(s1, 0, R.shape([256]), "bfloat16")
        _1 = R.call_packed("g", a, b, sinfo_args=[R.Tuple()])
        s2 = R.memory.alloc_storage(R.shape([512]), 0, "global", "bfloat16")
        c = R.memory.alloc_tensor(s2, 0, R.shape([256]), "bfloat16")
        _2 = R.call_packed("h", b, c, sinfo_args=[R.Tuple()])
        _3 = R.call_packed("k", c, {last_reads}out, sinfo_args=[R.Tuple()])
        return out
"""


def _planned(late_alias_use):
    """TVM's plan of three temporaries: a float32 tensor ``a`` (1024 B), then two bfloat16
    ones (512 B each); ``a`` is last read by the second call, before ``c`` is allocated,
    unless its alias ``a2`` is read by the last call."""
    return tvm.script.from_source(SOURCE.format(last_reads="a2, " if late_alias_use else ""),
                                  extra_vars={"I": I, "R": R})


def _storage_of(func, name):
    for block in func.body.blocks:
        for binding in block.bindings:
            if binding.var.name == name:
                return binding.value.args[0].name
    raise KeyError(name)


def test_a_freed_float32_block_hosts_a_later_bfloat16_tensor():
    before = _planned(late_alias_use=False)
    after = ShareStorageAcrossDtypes()(before)
    assert planned_bytes(before) == 2048
    assert planned_bytes(after) == 1536  # c in a's block: 1024 + 512
    func = after["main"]
    assert _storage_of(func, "c") == _storage_of(func, "a") != _storage_of(func, "b")


def test_a_tensor_read_through_an_alias_keeps_its_block():
    before = _planned(late_alias_use=True)
    after = ShareStorageAcrossDtypes()(before)
    # a lives to the last call through a2, b's block is free again when c is allocated: TVM's
    # plan (one block per dtype's tensors live together) is already as small, and kept
    assert planned_bytes(after) <= planned_bytes(before)
    func = after["main"]
    assert _storage_of(func, "c") != _storage_of(func, "a")


def _live_peak(tokens, sizes):
    """Bytes of the tensors alive together at the worst binding: no plan is smaller."""
    last = max(end for _, end in tokens.values())
    return max(sum(sizes[v] for v, (a, b) in tokens.items() if a <= i <= b)
               for i in range(last + 1))


def test_offsets_pack_small_tensors_where_a_large_one_lived():
    """A logits-sized tensor early, then two small ones alive together: shared objects
    put one small tensor in the large block and give the other a block of its own; offsets
    put both inside the large tensor's bytes (the lower bound, the largest live set)."""
    tokens = {"logits": [0, 1], "a": [2, 4], "b": [3, 5], "c": [6, 7]}
    sizes = {"logits": 4096, "a": 1024, "b": 1024, "c": 2048}
    _, blocks = assign_shared_objects(tokens, sizes)
    offset_of, arena = assign_offsets(tokens, sizes)
    assert sum(blocks) == 4096 + 1024
    assert arena == _live_peak(tokens, sizes) == 4096
    assert offset_of["a"] != offset_of["b"]
    assert all(o % ALIGNMENT == 0 for o in offset_of.values())


def test_offsets_never_overlap_tensors_alive_together():
    """On random lifetimes and sizes: every pair alive at once gets disjoint (aligned) bytes
    inside the arena, which is at least the bytes alive together (a check of the check)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(5, 60))
        starts = rng.integers(0, 100, n)
        tokens = {i: [int(s), int(s + rng.integers(0, 30))] for i, s in enumerate(starts)}
        sizes = {i: int(rng.integers(1, 5000)) for i in range(n)}
        offset_of, arena = assign_offsets(tokens, sizes)
        for i in range(n):
            assert offset_of[i] % ALIGNMENT == 0 and offset_of[i] + sizes[i] <= arena
            for j in range(i):
                (a, b), (c, d) = tokens[i], tokens[j]
                if a <= d and c <= b:  # alive together
                    assert (offset_of[i] + sizes[i] <= offset_of[j]
                            or offset_of[j] + sizes[j] <= offset_of[i]), (i, j)
        assert arena >= _live_peak(tokens, sizes)


ARENA_SOURCE = HEADER + """        _1 = R.call_packed("g", a, x, sinfo_args=[R.Tuple()])
        s1 = R.memory.alloc_storage(R.shape([512]), 0, "global", "bfloat16")
        b = R.memory.alloc_tensor(s1, 0, R.shape([256]), "bfloat16")
        _2 = R.call_packed("h", x, b, sinfo_args=[R.Tuple()])
        s2 = R.memory.alloc_storage(R.shape([512]), 0, "global", "bfloat16")
        c = R.memory.alloc_tensor(s2, 0, R.shape([256]), "bfloat16")
        _3 = R.call_packed("k", b, c, sinfo_args=[R.Tuple()])
        _4 = R.call_packed("m", c, b, out, sinfo_args=[R.Tuple()])
        return out
"""


def test_the_pass_places_tensors_in_one_arena():
    """a (float32, 1024 B) dies before b and c (bf16, 512 B each, alive together): TVM's
    plan keeps a pool per dtype (2048 B), shared
    objects need a's block and another (1536 B); offsets put b and c side by side in a's
    bytes, one arena of 1024 B, each tensor a view into it."""
    before = tvm.script.from_source(ARENA_SOURCE, extra_vars={"I": I, "R": R})
    after = ShareStorageAcrossDtypes()(before)
    script = after["main"].script()
    assert planned_bytes(before) == 2048
    assert planned_bytes(after) == 1024
    assert script.count("raf_dist.arena.view") == 3, script
    assert script.count("alloc_storage") == 1


def test_bf16_step_plans_less_and_computes_the_same(monkeypatch, tmp_path):
    """The small transformer's bf16 step: fewer planned bytes than TVM's per-dtype plan and
    bit-for-bit the same losses and parameters (the pass moves storage, not arithmetic)."""
    import raf_dist
    from raf_dist.compiler import build
    from models import make, raf_optimizer

    def train(cache):
        module, x, y = make("transformer", 8)
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                   optimizer=raf_optimizer("adamw"), precision="bf16",
                                   cache_dir=tmp_path / cache)
        losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(3)]
        return losses, trainer.state_dict(), trainer.stats()["planned_peak_bytes"]

    losses, params, shared = train("shared")
    monkeypatch.setattr(build, "ShareStorageAcrossDtypes", lambda: tvm.transform.Sequential([]))
    tvm_losses, tvm_params, per_dtype = train("per_dtype")
    assert shared < per_dtype, (shared, per_dtype)
    assert losses == tvm_losses
    for key, value in tvm_params.items():
        np.testing.assert_array_equal(params[key], value, err_msg=key)
