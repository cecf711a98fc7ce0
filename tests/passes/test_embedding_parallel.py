"""Embedding-table parallelism in one process (passes/embedding_parallel.py): which
parameters are tables, the plans (greedy by bytes, the user's, row blocks) and their checks,
the pieces a rank holds and the full tables back, the exchange op's gradient and lowering,
the ids check, the config's rules. The multi-process runs: tests/distributed/
test_embedding_parallel.py."""
import numpy as np
import pytest
import tvm
from tvm import relax

import raf_dist
from raf_dist import distributed as dist
from raf_dist.ir.ops import ep_exchange, is_ep_exchange
from raf_dist.passes.embedding_parallel import (EmbeddingPlan, LowerEmbeddingExchange,
                                                exchange_bytes, plan_embeddings)
from raf_dist.training import embedding_parallel as ep

from models import make, make_sharded_rec

TABLES = {"a.weight": (40, 8), "b.weight": (60, 8), "c.weight": (12, 8), "d.weight": (25, 8)}


@pytest.fixture(scope="module")
def rec():
    module, x, _ = make_sharded_rec(4)
    return raf_dist.frontend.from_pytorch(module, x), [a.numpy() for a in x]


def test_tables_are_the_lookup_only_parameters(rec):
    model, _ = rec
    tables = ep.make_plan(model, "row", 2).shapes
    assert tables == {"tables.0.weight": (40, 8), "tables.1.weight": (60, 8),
                      "tables.2.weight": (12, 8), "category.weight": (25, 8)}
    # a table tied to the output layer is a matrix too: not shardable by rows
    module, x, _ = make("tied", 2)
    with pytest.raises(ValueError, match="found no embedding table"):
        ep.make_plan(raf_dist.frontend.from_pytorch(module, (x,)), "table", 2)


def test_table_wise_balances_bytes_and_follows_the_users_plan():
    plan = plan_embeddings(TABLES, "table", 2)
    # largest first to the lighter rank: b -> 0, a -> 1, d -> 1, c -> 0
    assert plan.owners == {"a.weight": 1, "b.weight": 0, "c.weight": 0, "d.weight": 1}
    assert plan.held_bytes(0) == (60 + 12) * 32 and plan.held_bytes(1) == (40 + 25) * 32
    placed = plan_embeddings(TABLES, "table", 3, {"b": 2, "[ac]*": 0})  # module name, pattern
    assert placed.owners["b.weight"] == 2 and placed.owners["a.weight"] == 0
    assert placed.owners["c.weight"] == 0 and placed.owners["d.weight"] == 1
    assert placed.local_shape("b.weight", (60, 8), 0) == (0, 8)
    assert placed.holders("b.weight") == [2]


@pytest.mark.parametrize("mode,plan,message", [
    ("table", {"e": 0}, "names 'e', which is no embedding table"),
    ("table", {"a": 2}, "outside the data-parallel group of 2 ranks"),
    ("table", {"a": True}, "outside the data-parallel group"),
    ("row", {"a": 0}, "needs embedding_parallel='table'"),
    ("rows", None, "embedding_parallel must be one of"),
])
def test_bad_plans_name_the_problem(mode, plan, message):
    with pytest.raises(ValueError, match=message):
        plan_embeddings(TABLES, mode, 2, plan)


def test_row_blocks_pad_the_last_rank_and_assemble_back():
    plan = plan_embeddings({"t": (5, 3)}, "row", 4)
    assert [plan.row_range("t", r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    full = np.arange(15, dtype=np.float32).reshape(5, 3)
    pieces = [plan.local_shard("t", full, r) for r in range(4)]
    assert all(p.shape == (2, 3) for p in pieces)
    assert not pieces[2][1:].any() and not pieces[3].any()  # zero padding
    np.testing.assert_array_equal(plan.assemble("t", pieces), full)
    owned = plan_embeddings({"t": (5, 3)}, "table", 2)
    np.testing.assert_array_equal(owned.assemble("t", [owned.local_shard("t", full, r)
                                                        for r in range(2)]), full)


def test_exchange_bytes_count_ids_rows_and_gradients():
    plan = EmbeddingPlan("table", 2, {"t": (10, 4)}, {"t": 1})
    # rank 0 sends 6 ids (4 B) and the rows' gradients (6 x 4 x 4 B) to the owner
    assert exchange_bytes(plan, 0, {"t": [6]}) == 6 * 4 + 6 * 16
    assert exchange_bytes(plan, 1, {"t": [6]}) == 6 * 16  # the rows back to rank 0
    rows = EmbeddingPlan("row", 3, {"t": (10, 4)})
    assert exchange_bytes(rows, 0, {"t": [5]}) == 2 * 5 * 4 + 2 * 5 * 16 + 2 * 5 * 16


def test_pooled_bytes_count_pairs_weights_and_pooled_blocks():
    """A bag pooling (passes/embedding_pooled.py): rank 0 sends 6 (id, bag) int32 pairs and
    their weights to the owner, and the 2 pooled rows' gradients; the owner sends back the 2
    pooled rows instead of 6 rows."""
    plan = EmbeddingPlan("table", 2, {"t": (10, 4)}, {"t": 1})
    assert exchange_bytes(plan, 0, {"t": [(6, 2, True)]}) == 6 * (8 + 4) + 2 * 16
    assert exchange_bytes(plan, 1, {"t": [(6, 2, False)]}) == 2 * 16
    rows = EmbeddingPlan("row", 3, {"t": (10, 4)})  # partial pooled blocks to every rank
    assert exchange_bytes(rows, 0, {"t": [(5, 2, False)]}) == 2 * 5 * 8 + 2 * 2 * 16 * 2


def test_bags_are_pooled_on_the_holders(rec):
    """ShardedRec's three nn.EmbeddingBag lookups (sum with per-sample weights, mean with a
    padding id, sum) are found as poolings; its nn.Embedding is not one. Sharded, each
    pooling's exchange sends (id, bag) pairs and gets back (bags, dim) blocks: the forward has
    no (ids, dim) exchange left but the category's."""
    from raf_dist.passes.embedding_pooled import find_pooled
    from raf_dist.passes.embedding_parallel import shard_embedding_forward
    from raf_dist.passes.tensor_parallel import vars_by_name

    model, _ = rec
    names = list(model.param_names)
    tables = ep.make_plan(model, "table", 2, None)
    by_name = vars_by_name(model.forward, names)
    sites = find_pooled(model.forward, [by_name[n] for n in tables.names])
    pooled = {n: s for s in sites.values() for n, v in by_name.items() if v.same_as(s.table)}
    assert sorted(pooled) == ["tables.0.weight", "tables.1.weight", "tables.2.weight"]
    assert [pooled[f"tables.{i}.weight"].weights is not None for i in range(3)] == \
        [True, False, False]
    sharded = shard_embedding_forward(model.forward, tables, 0, names)
    exchanged = [b.value for blk in sharded.body.blocks for b in blk.bindings
                 if is_ep_exchange(b.value)]
    shapes = sorted(tuple(int(d) for d in call.args[0].ty.shape)[1:] for call in exchanged)
    # per pooling: (id, bag) pairs out, weights (table 0), the pooled blocks back; the
    # category: ids out and rows back
    assert shapes.count((2,)) == 3 and shapes.count(()) == 2, shapes


def _exchange_module(send, recv):
    x = relax.Var("x", relax.TensorType((sum(send), 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(ep_exchange(x, send, recv))
            out = bb.emit_output(relax.op.sum(relax.op.multiply(y, y)))
        bb.emit_func_output(out)
    return bb.get()


def test_the_exchange_gradient_is_the_reverse_exchange():
    mod = relax.transform.Gradient("main")(_exchange_module([2, 3], [4, 4]))
    calls = [b.value for blk in mod["main_adjoint"].body.blocks for b in blk.bindings
             if is_ep_exchange(b.value)]
    assert [([int(v) for v in c.attrs["send"]], [int(v) for v in c.attrs["recv"]])
            for c in calls] == [([2, 3], [4, 4]), ([4, 4], [2, 3])]
    assert [int(d) for d in calls[1].ty.shape] == [5, 3]
    x = relax.Var("x", relax.TensorType((5, 3), "float32"))
    with pytest.raises(ValueError, match="sends 6 rows of a tensor of 5"):
        ep_exchange(x, [3, 3], [1, 1])


def test_lowering_calls_alltoallv_with_element_counts():
    lowered = LowerEmbeddingExchange(7)(_exchange_module([2, 3], [4, 4]))
    assert not any(is_ep_exchange(b.value) for blk in lowered["main"].body.blocks
                   for b in blk.bindings)
    consts = [b.value.args[i].value.numpy() for blk in lowered["main"].body.blocks
              for b in blk.bindings if isinstance(b.value, relax.Call)
              and isinstance(b.value.op, relax.ExternFunc)
              and b.value.op.global_symbol == "raf_dist.ccl.alltoall" for i in (1, 2)]
    assert [c.tolist() for c in consts] == [[6, 9], [12, 12]]  # rows x 3 elements
    assert all(c.dtype == np.int64 for c in consts)  # the runtime reads host int64 counts


def test_ids_outside_a_table_are_refused_before_any_exchange(rec):
    model, x = rec
    check = ep.IdsCheck(ep.make_plan(model, "table", 2), model.at_batch, len(x))
    check(x, 4)
    bad = [a.copy() for a in x]
    bad[1][3, 2, 0] = -1  # table 2
    with pytest.raises(ValueError, match="'tables.2.weight' has 12 rows and was asked for row -1"):
        check(bad, 4)
    bad = [a.copy() for a in x]
    bad[2][0] = 25  # the category table
    with pytest.raises(ValueError, match="'category.weight' has 25 rows and was asked for row 25"):
        check(bad, 4)


def test_config_rules():
    config = dist.get_config()
    try:
        with pytest.raises(ValueError, match="embedding_parallel must be one of"):
            config.embedding_parallel = "column"
        config.embedding_parallel = "table"
        with pytest.raises(ValueError, match="requires enable_data_parallel=True"):
            config.check()
        config.update({"enable_data_parallel": True, "zero_opt_level": 1})
        config.check_supported()  # ZeRO for the dense layers beside the sharded tables
        config.num_microbatches = 2
        config.check_supported()  # and gradient accumulation with them
        config.update({"num_microbatches": 1, "tensor_parallel_size": 2})
        config.check_supported()  # the dense layers split over tp, the tables whole
        config.update({"tensor_parallel_size": 1, "pipeline_parallel_size": 2})
        with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2 is not built"):
            config.check_supported()
        config.update({"pipeline_parallel_size": 1, "zero_opt_level": 0,
                       "activation_memory_budget_mb": 100})
        config.check_supported()  # one policy for the dp group: the largest rank's peaks
    finally:
        config.reset()


def test_a_world_of_one_trains_the_tables_whole(rec):
    """embedding_parallel in a world of one: nothing to shard, the Trainer trains as without
    it (a script runs unchanged at any size)."""
    model, x = rec
    config = dist.get_config()
    try:
        config.update({"enable_data_parallel": True, "embedding_parallel": "table"})
        trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1),
                                   embedding_plan={"tables.0": 0})
        assert trainer.executor.ep_plan is None
        assert np.isfinite(trainer.step(x, np.array([0, 1, 0, 1])))
    finally:
        config.reset()
