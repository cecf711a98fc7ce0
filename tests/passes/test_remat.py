"""The recomputation pass's choices on a small graph (passes/remat.py): two residual blocks
``h = relu(x @ w) + x``; TVM's Gradient writes the adjoint; the pass must leave the forward
as it was and make the backward read recomputed copies of exactly the values the policy does
not keep."""
import pytest
import tvm
from tvm import relax

from raf_dist.passes.remat import Cheapest, FullBlocks, ladder, ranked, rematerialize


def _adjoint():
    """(adjoint, number of forward bindings, {name: forward var}) of
    sum(relu(relu(x @ w1) + x) @ w2) + ...) with two residual joins."""
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w1 = relax.Var("w1", relax.TensorType((8, 8), "float32"))
    w2 = relax.Var("w2", relax.TensorType((8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            mm1 = bb.emit(relax.op.matmul(x, w1), "mm1")
            act1 = bb.emit(relax.op.tanh(mm1), "act1")
            join1 = bb.emit(relax.op.add(act1, x), "join1")
            mm2 = bb.emit(relax.op.matmul(join1, w2), "mm2")
            act2 = bb.emit(relax.op.tanh(mm2), "act2")
            join2 = bb.emit(relax.op.add(act2, join1), "join2")
            loss = bb.emit_output(relax.op.sum(bb.emit(relax.op.multiply(join2, join2), "sq")),
                                  "loss")
        bb.emit_func_output(loss)
    mod = bb.get()
    forward = mod["main"]
    n_forward = len(forward.body.blocks[0].bindings)
    adjoint = relax.transform.Gradient("main", require_grads=[forward.params[1],
                                                              forward.params[2]])(mod)
    adjoint = adjoint["main_adjoint"]
    names = {b.var.name: b.var for b in adjoint.body.blocks[0].bindings[:n_forward]}
    return adjoint, n_forward, names


def _backward_reads(func, n_forward):
    """Names of the forward values the backward bindings read, and the recomputed copies
    (name -> op name)."""
    bindings = list(func.body.blocks[0].bindings)
    forward = {b.var for b in bindings[:n_forward]}
    reads, copies = set(), {}
    for b in bindings[n_forward:]:
        if b.var.name.endswith("_re"):
            copies[b.var.name[:-3]] = b.value.op.name
            continue
        reads |= {v.name for v in relax.analysis.free_vars(b.value) if v in forward}
    return reads, copies


def test_without_recomputation_the_backward_reads_the_activations():
    adjoint, n_forward, _ = _adjoint()
    reads, copies = _backward_reads(adjoint, n_forward)
    assert copies == {} and {"act1", "act2", "join1", "join2"} <= reads


@pytest.mark.parametrize("policy, kept, recomputed", [
    # full: the block inputs (residual joins) kept; the first block (from x) and the second
    # (from join1) recomputed; everything after the last join (the loss) kept
    ("full", {"join1", "join2", "sq"}, {"mm1": "relax.matmul", "mm2": "relax.matmul",
                                        "act1": "relax.tanh", "act2": "relax.tanh"}),
    # selective: the matmul outputs kept; the tanh outputs (their gradient reads them) and
    # the joins (the matmuls' and the square's gradients read them) recomputed
    ("selective", {"mm1", "mm2"}, {"act1": "relax.tanh", "act2": "relax.tanh",
                                   "join1": "relax.add", "join2": "relax.add"}),
    # a budget's points: all of selective's values one at a time is selective; the first
    # block as full, the second as selective (its matmul output kept, its tanh recomputed;
    # join2 kept: it is a block boundary); every block is full
    (Cheapest(4), {"mm1", "mm2"}, {"act1": "relax.tanh", "act2": "relax.tanh",
                                   "join1": "relax.add", "join2": "relax.add"}),
    (FullBlocks(1), {"join1", "join2", "mm2"}, {"mm1": "relax.matmul", "act1": "relax.tanh",
                                                "act2": "relax.tanh"}),
    (FullBlocks(2), {"join1", "join2", "sq"}, {"mm1": "relax.matmul", "mm2": "relax.matmul",
                                               "act1": "relax.tanh", "act2": "relax.tanh"}),
], ids=["full", "selective", "cheapest-all", "full-blocks-1", "full-blocks-all"])
def test_the_backward_reads_only_what_the_policy_keeps(policy, kept, recomputed):
    adjoint, n_forward, names = _adjoint()
    after = rematerialize(adjoint, n_forward, 1, policy, names["loss"])
    # the forward is untouched
    tvm.ir.assert_structural_equal(
        relax.DataflowBlock(list(after.body.blocks[0].bindings[:n_forward])),
        relax.DataflowBlock(list(adjoint.body.blocks[0].bindings[:n_forward])))
    reads, copies = _backward_reads(after, n_forward)
    assert reads <= kept, reads - kept
    assert copies == recomputed
    relax.analysis.well_formed(tvm.IRModule({tvm.ir.GlobalVar("main_adjoint"): after}))


def test_a_copy_is_made_once_right_before_its_first_backward_use():
    adjoint, n_forward, names = _adjoint()
    after = rematerialize(adjoint, n_forward, 1, "full", names["loss"])
    bindings = list(after.body.blocks[0].bindings)
    position = {b.var.name: i for i, b in enumerate(bindings)}
    names = [b.var.name for b in bindings]
    assert len([n for n in names if n.endswith("_re")]) == len({n for n in names
                                                                 if n.endswith("_re")})
    # the second block's copies come before the first block's (backward runs last block
    # first), each after the forward
    assert n_forward <= position["mm2_re"] < position["mm1_re"]


def test_unknown_policy_is_refused():
    adjoint, n_forward, names = _adjoint()
    with pytest.raises(ValueError, match="'full', 'selective'"):
        rematerialize(adjoint, n_forward, 1, "everything", names["loss"])


def test_a_budgets_points_run_from_none_through_selective_to_full():
    """ladder: selective's four values (the tanh outputs and the joins: the backward reads
    them, they are not matmul outputs) one at a time, then the two blocks. Cheapest(k)
    recomputes the k lowest-scored of them and the backward keeps reading the others."""
    adjoint, n_forward, names = _adjoint()
    assert ladder(adjoint, n_forward, 1, names["loss"]) == (4, 2)
    order = [v.name for v in ranked(adjoint, n_forward, 1)]
    assert sorted(order) == ["act1", "act2", "join1", "join2"]
    for count in range(5):
        after = rematerialize(adjoint, n_forward, 1, Cheapest(count), names["loss"])
        reads, copies = _backward_reads(after, n_forward)
        assert set(copies) == set(order[:count]), count
        assert set(order[count:]) <= reads and not set(order[:count]) & reads, count


def test_the_score_recomputes_values_cheap_per_byte_and_read_once_first():
    """RAF's score (recompute cost / byte + 0.1) x (backward uses + 1), the cost the elements
    the op moves: an elementwise value read once goes before a row sum, whose small output
    costs its whole input and which the backward reads twice."""
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            mm = bb.emit(relax.op.matmul(x, w), "mm")
            y = bb.emit(relax.op.tanh(mm), "y")  # read once: by tanh's gradient
            s = bb.emit(relax.op.sum(y, axis=[1]), "s")  # read twice: by s * s's gradient
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(s, s)), "loss")
        bb.emit_func_output(loss)
    mod = bb.get()
    n_forward = len(mod["main"].body.blocks[0].bindings)
    adjoint = relax.transform.Gradient("main", require_grads=[mod["main"].params[1]])(mod)
    order = [v.name for v in ranked(adjoint["main_adjoint"], n_forward, 1)]
    assert "mm" not in order  # matmul outputs are "selective"'s, never a ranked value
    assert order == ["y", "s"]
