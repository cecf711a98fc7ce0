"""Vocabulary parallelism (DESIGN.md 3b): the token table split along its rows and the tied
output head along its classes (plan_tensor_parallel / shard_forward with ``split_output``;
Before / Expected, structural equality), the rows > ids rule for an untied table, a
vocabulary T does not divide padded to a multiple of T (passes/tp_padding.py: zero rows, the
padded logits masked), the IR of the vocabulary-parallel cross-entropy (build_loss(...,
vocab_parallel=True)), and its numerics (and those of the whole sharded LM, padded or not),
run for T ranks in one process: the SPMD function is simulated in lockstep (each binding
emitted once per rank, each collective computed from all ranks' values) and compared with
PyTorch. Single process, no MPI."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

import raf_dist  # noqa: F401  (registers the gradients the loss and the forward need)
from raf_dist.passes.gradient_markers import SubstituteVars
from raf_dist.passes.tensor_parallel import plan_tensor_parallel
from raf_dist.passes.tp_plan import Placement
from raf_dist.passes.tp_shard import shard_forward
from raf_dist.passes.tp_ops import (TP_COPY, TP_MAX, TP_RANK, TP_REDUCE, is_tp_op, tp_copy,
                                    tp_rank, tp_reduce)
from raf_dist.passes.tp_padding import Padding, masked_logit
from raf_dist.training.cross_entropy import CROSS_ENTROPY
from raf_dist.training.loss import build_loss

F32 = "float32"
BATCH, SEQ, VOCAB, DIM = 2, 4, 16, 8  # 8 ids per step, a table of 16 rows
TIED = ["wte", "ln.weight", "ln.bias"]
UNTIED = TIED + ["head.weight"]
op = relax.op


# ---- helpers (as tests/passes/test_tensor_parallel.py) -------------------------------------
def bindings(func):
    return [(b.var, b.value) for block in func.body.blocks for b in block.bindings]


def op_calls(func, op_name):
    return [(var, value) for var, value in bindings(func)
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == op_name]


def shape_of(expr):
    return tuple(int(d) for d in expr.ty.shape)


def tensor(name, *shape, dtype=F32):
    return relax.Var(name, relax.TensorType(shape, dtype))


def _vocab_lookup(bb, table, ids, rows):
    """What shard_forward's vocabulary-parallel take must be, written out: the ids in this
    rank's range [r rows, (r+1) rows) looked up locally, zeros for the others."""
    rank = bb.emit(tp_rank(ids))
    start = bb.emit(op.astype(op.multiply(rank, relax.const(rows, "int64")), "int32"))
    local = bb.emit(op.subtract(ids, start))
    inside = bb.emit(op.logical_and(op.greater_equal(local, relax.const(0, "int32")),
                                    op.less(local, relax.const(rows, "int32"))))
    safe = bb.emit(op.where(inside, local, relax.const(0, "int32")))
    looked_up = bb.emit(op.take(table, safe, axis=0, mode="fast"))
    keep = bb.emit(op.expand_dims(inside, [-1]))
    return op.where(keep, looked_up, relax.const(0.0, F32))


def _masked(bb, logits, local, classes):
    """What shard_forward appends to padded logits, written out: the columns of this rank's
    slice [r local, (r+1) local) from ``classes`` on set to the masked logit."""
    column = bb.emit(op.arange(0, local, 1, "int64"))
    start = bb.emit(op.multiply(tp_rank(column), relax.const(local, "int64")))
    keep = bb.emit(op.less(op.add(column, start), relax.const(classes, "int64")))
    return op.where(keep, logits, relax.const(masked_logit(F32), F32))


def lm_forward(batch=BATCH, seq=SEQ, vocab=VOCAB, d=DIM, tied=True, tp=1, sharded=False,
               split_head=True, padded=None):
    """ids -> embedding (as from_pytorch emits nn.Embedding: astype int32, flatten, take,
    reshape) -> layer_norm -> head (the table itself when ``tied``, else its own weight, as
    nn.Linear: permute_dims, matmul) -> logits, the output.

    ``sharded``: what shard_forward should make of it at ``tp`` ranks: the table's rows
    split, the lookup vocabulary parallel followed by g (tp_reduce); with ``split_head`` the
    head's classes split too (column parallel, the logits stay split for the vocabulary-
    parallel cross-entropy) and f (tp_copy) on the normalized hidden state it reads.
    ``padded``: the vocabulary's size once padded to a multiple of ``tp`` (the table's and
    a split head's rows; the split logits' padded classes masked)."""
    padded = padded or vocab
    rows = padded // tp if sharded else vocab
    classes = padded // tp if sharded and split_head else vocab
    ids = tensor("x", batch, seq, dtype="int64")
    params = [tensor("p_wte", rows, d), tensor("p_ln_weight", d), tensor("p_ln_bias", d)]
    if not tied:
        params.append(tensor("p_head_weight", classes, d))
    wte, ln_w, ln_b = params[:3]
    head = wte if tied else params[3]
    bb = relax.BlockBuilder()
    with bb.function("forward", [ids, *params], attrs={"num_input": 1}, pure=True):
        with bb.dataflow():
            flat = bb.emit(op.reshape(bb.emit(op.astype(ids, "int32")), [-1]))
            if sharded:
                part = bb.emit(_vocab_lookup(bb, wte, flat, rows))
                emb = bb.emit(tp_reduce(part))
            else:
                emb = bb.emit(op.take(wte, flat, axis=0, mode="fast"))
            emb = bb.emit(op.reshape(emb, [batch, seq, d]))
            h = bb.emit(op.nn.layer_norm(emb, ln_w, ln_b, axes=[-1]))
            wt = bb.emit(op.permute_dims(head, axes=[1, 0]))
            if sharded and split_head:
                h = bb.emit(tp_copy(h))
            logits = bb.emit(op.matmul(h, wt, out_dtype=F32))
            if sharded and split_head and padded != vocab:  # the output binding, masked
                gv = bb.emit_output(_masked(bb, bb.emit(logits), classes, vocab))
            else:
                gv = bb.emit_output(logits)
        bb.emit_func_output(gv)
    return bb.get()["forward"]


def vocab_plan(before, tp, names, split_output=True):
    return plan_tensor_parallel(before, tp, names, names, split_output=split_output)


# ---- 1. vocabulary-parallel embedding + tied head, Before / Expected -----------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_tied_embedding_and_head_split_along_the_vocabulary(tp):
    before = lm_forward()
    plan = vocab_plan(before, tp, TIED)
    assert plan.placements == {"wte": Placement(0, 1, "vocab+colwise")}
    assert set(plan.replicated) == {"ln.weight", "ln.bias"}
    assert plan.output_split
    tokens = BATCH * SEQ
    assert plan.forward_reduces == [tokens * DIM]  # g after the lookup
    assert plan.backward_reduces == [tokens * DIM]  # f on the hidden state the head reads
    assert plan.loss_reduces == [tokens] * 3  # max, sum of exponentials, target logit
    after = shard_forward(before, tp, TIED, TIED, plan)
    tvm.ir.assert_structural_equal(after, lm_forward(tp=tp, sharded=True))
    assert shape_of(after.params[1]) == (VOCAB // tp, DIM)
    assert shape_of(after.body.body) == (BATCH, SEQ, VOCAB // tp)
    assert len(op_calls(after, TP_RANK)) == 1
    assert len(op_calls(after, TP_REDUCE)) == 1 and len(op_calls(after, TP_COPY)) == 1
    assert "vocabulary-parallel" in plan.explain()


def test_tied_head_without_split_output_stays_replicated():
    """Splitting the table splits the tied head, whose logits would leave the forward split:
    without a vocabulary-parallel loss nothing splits, and the reason says so."""
    before = lm_forward()
    plan = vocab_plan(before, 2, TIED, split_output=False)
    assert plan.placements == {} and not plan.output_split and plan.loss_reduces == []
    why = plan.replicated["wte"]
    assert "output of the forward" in why and "cross_entropy" in why, why
    tvm.ir.assert_structural_equal(shard_forward(before, 2, TIED, TIED, plan), before)


@pytest.mark.parametrize("tp", [2, 4])
def test_untied_head_without_split_output_keeps_only_the_embedding_split(tp):
    """An untied head cannot stay split either (its reason names the output); the table,
    with more rows (16) than the ids a step looks up (8), still splits on its own: one g,
    no f, the logits whole."""
    before = lm_forward(tied=False)
    plan = vocab_plan(before, tp, UNTIED, split_output=False)
    assert plan.placements == {"wte": Placement(0, 1, "vocab")}
    why = plan.replicated["head.weight"]
    assert "output of the forward" in why and "cross_entropy" in why, why
    assert plan.forward_reduces == [BATCH * SEQ * DIM] and plan.backward_reduces == []
    assert not plan.output_split
    after = shard_forward(before, tp, UNTIED, UNTIED, plan)
    tvm.ir.assert_structural_equal(after, lm_forward(tied=False, tp=tp, sharded=True,
                                                     split_head=False))
    assert shape_of(after.body.body) == (BATCH, SEQ, VOCAB)


@pytest.mark.parametrize("seq", [8, 16], ids=["rows-equal-ids", "rows-fewer-than-ids"])
def test_table_not_larger_than_the_ids_stays_replicated(seq):
    """16 rows looking up 16 (or 32) ids per step: splitting would cost an allreduce of the
    rows looked up for little memory; the reason gives both numbers."""
    before = lm_forward(tied=False, seq=seq)
    plan = vocab_plan(before, 2, UNTIED, split_output=False)
    assert plan.placements == {}
    why = plan.replicated["wte"]
    assert f"{VOCAB} rows" in why and f"{BATCH * seq} ids" in why, why
    assert "output of the forward" in plan.replicated["head.weight"]
    tvm.ir.assert_structural_equal(shard_forward(before, 2, UNTIED, UNTIED, plan), before)


def test_untied_head_with_split_output_splits_both():
    before = lm_forward(tied=False)
    plan = vocab_plan(before, 2, UNTIED)
    assert plan.placements == {"wte": Placement(0, 1, "vocab"),
                               "head.weight": Placement(0, 1, "colwise")}
    assert plan.output_split
    after = shard_forward(before, 2, UNTIED, UNTIED, plan)
    tvm.ir.assert_structural_equal(after, lm_forward(tied=False, tp=2, sharded=True))


def test_explicit_plan_splits_a_tied_table():
    """torchtitan's name for a table split along the vocabulary is "rowwise"
    (_explicit_groups); the tied table then also splits the head: the same placement as the
    search finds."""
    before = lm_forward()
    plan = plan_tensor_parallel(before, 2, TIED, TIED, plan={"wte": "rowwise"},
                                split_output=True)
    assert plan.placements == {"wte": Placement(0, 1, "vocab+colwise")}


def test_explicit_plan_splits_an_untied_table_and_head():
    before = lm_forward(tied=False)
    plan = plan_tensor_parallel(before, 2, UNTIED, UNTIED,
                                plan={"wte": "rowwise", "head": "colwise"}, split_output=True)
    assert plan.placements == {"wte": Placement(0, 1, "vocab"),
                               "head.weight": Placement(0, 1, "colwise")}


# ---- 1b. a vocabulary T does not divide: padded to a multiple of T -------------------------
ODD = 13  # 14 rows at T = 2 (one zero row), 16 at T = 4 (three)


@pytest.mark.parametrize("tp", [2, 4])
def test_tied_vocabulary_tp_does_not_divide_is_padded_and_its_logits_masked(tp):
    """Megatron's make-vocab-size-divisible-by: the table gets zero rows up to a multiple of
    T and splits as one that divides; the padded classes of the logits are masked before
    they leave the forward; the plan keeps the true shape and says so."""
    before = lm_forward(vocab=ODD)
    plan = vocab_plan(before, tp, TIED)
    padded = -(-ODD // tp) * tp
    assert plan.placements == {"wte": Placement(0, 1, "vocab+colwise")}
    assert plan.padding == {"wte": Padding(0, ODD, padded)}
    assert plan.shapes["wte"] == (ODD, DIM) and plan.padded_shape("wte") == (padded, DIM)
    assert plan.output_split and plan.output_classes == ODD
    tokens = BATCH * SEQ  # the collectives are those of a vocabulary that divides
    assert plan.forward_reduces == [tokens * DIM] and plan.backward_reduces == [tokens * DIM]
    assert plan.loss_reduces == [tokens] * 3
    after = shard_forward(before, tp, TIED, TIED, plan)
    tvm.ir.assert_structural_equal(after, lm_forward(vocab=ODD, tp=tp, sharded=True,
                                                     padded=padded))
    assert shape_of(after.params[1]) == (padded // tp, DIM)
    assert shape_of(after.body.body) == (BATCH, SEQ, padded // tp)
    text = plan.explain()
    assert f"padded to {padded} ({padded - ODD} zero row" in text, text
    assert f"the vocabulary of {ODD} is padded to {padded}" in text, text
    assert "masked out of the loss and predict" in text, text


def test_untied_vocabulary_pads_the_table_and_the_head_apart():
    before = lm_forward(vocab=ODD, tied=False)
    plan = vocab_plan(before, 2, UNTIED)
    assert plan.placements == {"wte": Placement(0, 1, "vocab"),
                               "head.weight": Placement(0, 1, "colwise")}
    assert plan.padding == {"wte": Padding(0, ODD, 14), "head.weight": Padding(0, ODD, 14)}
    after = shard_forward(before, 2, UNTIED, UNTIED, plan)
    tvm.ir.assert_structural_equal(after, lm_forward(vocab=ODD, tied=False, tp=2, sharded=True,
                                                     padded=14))


def test_padded_table_without_split_output_has_no_mask():
    """Without a vocabulary-parallel loss the untied head stays whole (its reason is the
    output, not the vocabulary's size) and its logits have V classes; only the table, read by
    ids < V alone, is padded. A tied table cannot split at all, whatever its size."""
    before = lm_forward(vocab=ODD, tied=False)
    plan = vocab_plan(before, 2, UNTIED, split_output=False)
    assert plan.placements == {"wte": Placement(0, 1, "vocab")}
    assert plan.padding == {"wte": Padding(0, ODD, 14)} and not plan.output_split
    assert "output of the forward" in plan.replicated["head.weight"]
    after = shard_forward(before, 2, UNTIED, UNTIED, plan)
    tvm.ir.assert_structural_equal(after, lm_forward(vocab=ODD, tied=False, tp=2, sharded=True,
                                                     split_head=False, padded=14))
    assert "masked" not in plan.explain()
    tied = vocab_plan(lm_forward(vocab=ODD), 2, TIED, split_output=False)
    assert tied.placements == {} and tied.padding == {}
    assert "output of the forward" in tied.replicated["wte"], tied.replicated


def test_padded_pieces_hold_zero_rows_and_assemble_to_the_true_shape():
    plan = vocab_plan(lm_forward(vocab=ODD), 4, TIED)
    full = np.arange(ODD * DIM, dtype=F32).reshape(ODD, DIM)
    pieces = [plan.local_shard("wte", full, r) for r in range(4)]
    assert all(p.shape == (4, DIM) for p in pieces)
    np.testing.assert_array_equal(pieces[3][1:], 0)  # rows 13..15: the padding
    np.testing.assert_array_equal(plan.assemble("wte", pieces), full)


# ---- 2. vocabulary-parallel cross-entropy, IR ---------------------------------------------
@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 4)], ids=["rows", "batch-seq"])
def test_vocab_parallel_cross_entropy_ir(shape):
    func, (target_shape, target_dtype) = build_loss("cross_entropy", shape, F32,
                                                    vocab_parallel=True)
    assert target_shape == shape[:-1] and target_dtype == "int64"
    assert len(op_calls(func, TP_MAX)) == 1
    assert len(op_calls(func, TP_REDUCE)) == 2
    assert len(op_calls(func, TP_RANK)) == 1
    assert op_calls(func, TP_COPY) == []
    assert op_calls(func, "relax.nn.log_softmax") == []
    assert op_calls(func, "relax.nn.nll_loss") == []
    rows = int(np.prod(shape[:-1]))
    for _, call in op_calls(func, TP_MAX) + op_calls(func, TP_REDUCE):  # one value per row
        assert int(np.prod(shape_of(call.args[0]))) == rows


def test_plain_cross_entropy_has_no_collectives():
    func, _ = build_loss("cross_entropy", (6, 12), F32)
    for name in (TP_MAX, TP_REDUCE, TP_RANK, TP_COPY):
        assert op_calls(func, name) == [], name
    assert len(op_calls(func, CROSS_ENTROPY)) == 1  # the fused op (training/cross_entropy.py)


# ---- 3. numerics: T ranks simulated in lockstep in one process ------------------------------
def _subst(expr, mapping):
    return SubstituteVars(mapping).visit_expr(expr)


def simulate(func, tp, name):
    """``func`` (an SPMD function, tp ops included) run by ``tp`` ranks as one function of
    every rank's arguments (rank 0's, then rank 1's, ...), returning every rank's outputs as
    a tuple. Bindings are emitted once per rank in order; tp_rank(x) is the rank, tp_copy(x)
    x, tp_reduce / tp_max the sum / max of all ranks' values (which the ranks all see)."""
    params = [[relax.Var(f"{p.name}_{r}", p.ty) for p in func.params] for r in range(tp)]
    maps = [dict(zip(func.params, ps)) for ps in params]
    bb = relax.BlockBuilder()
    with bb.function(name, [v for ps in params for v in ps]):
        for var, value in bindings(func):
            if is_tp_op(value):
                args = [_subst(value.args[0], m) for m in maps]
                if is_tp_op(value, TP_RANK):
                    new = [relax.const(r, "int64") for r in range(tp)]
                elif is_tp_op(value, TP_COPY):
                    new = args
                else:
                    combine = op.maximum if is_tp_op(value, TP_MAX) else op.add
                    total = args[0]
                    for a in args[1:]:
                        total = bb.emit(combine(total, a))
                    new = [total] * tp
            else:
                new = [bb.emit(_subst(value, m)) for m in maps]
            for m, n in zip(maps, new):
                m[var] = n
        bb.emit_func_output(relax.Tuple([_subst(func.body.body, m) for m in maps]))
    return bb.get()[name]


def adjoint(func, wrt):
    """``func``'s adjoint (value, (gradients of the parameters at indices ``wrt``))."""
    mod = relax.transform.Gradient("main", require_grads=[func.params[i] for i in wrt])(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
    return mod["main_adjoint"]


def loss_of_forward(forward, loss):
    """loss(forward(...), target) as one function of (forward's arguments..., target)."""
    target = loss.params[1]
    bb = relax.BlockBuilder()
    with bb.function("main", [*forward.params, target]):
        with bb.dataflow():
            m = {}
            for var, value in bindings(forward):
                m[var] = bb.emit(_subst(value, m))
            m[loss.params[0]] = _subst(forward.body.body, m)
            for var, value in bindings(loss):
                m[var] = bb.emit(_subst(value, m))
            gv = bb.emit_output(_subst(loss.body.body, m))
        bb.emit_func_output(gv)
    return bb.get()["main"]


ROWS, CLASSES = 6, 12
CE_TPS = (1, 2, 4)
LM_TPS = (2, 4)
# padded vocabularies: (V, T, tied); 5 at T = 4 is 8 rows, the last rank's two all padding
PADDED_LMS = {"pad_tied_13_tp2": (ODD, 2, True), "pad_tied_5_tp4": (5, 4, True),
              "pad_untied_13_tp2": (ODD, 2, False)}


@pytest.fixture(scope="module")
def vm():
    """Every simulated function in one module, compiled once (2 cores are shared)."""
    funcs = {}
    for tp in CE_TPS:
        loss, _ = build_loss("cross_entropy", (ROWS, CLASSES // tp), F32, vocab_parallel=True)
        funcs[f"ce_{tp}"] = simulate(adjoint(loss, [0]), tp, f"ce_{tp}")
    for tp in LM_TPS:
        before = lm_forward()
        plan = vocab_plan(before, tp, TIED)
        forward = shard_forward(before, tp, TIED, TIED, plan)
        loss, _ = build_loss("cross_entropy", (BATCH, SEQ, VOCAB // tp), F32,
                             vocab_parallel=True)
        step = adjoint(loss_of_forward(forward, loss), [1, 2, 3])
        funcs[f"lm_{tp}"] = simulate(step, tp, f"lm_{tp}")
    for key, (vocab, tp, tied) in PADDED_LMS.items():
        names = TIED if tied else UNTIED
        before = lm_forward(vocab=vocab, tied=tied)
        forward = shard_forward(before, tp, names, names, vocab_plan(before, tp, names))
        loss, _ = build_loss("cross_entropy", (BATCH, SEQ, -(-vocab // tp)), F32,
                             vocab_parallel=True)
        step = adjoint(loss_of_forward(forward, loss), list(range(1, 1 + len(names))))
        funcs[key] = simulate(step, tp, key)
    mod = tvm.IRModule(funcs)
    for func in mod.functions.values():  # no collective is left to lower
        for name in (TP_COPY, TP_REDUCE, TP_MAX, TP_RANK):
            assert op_calls(func, name) == []
    return relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())


def _run(vm, name, args):
    return vm[name](*[tvm.runtime.tensor(a) for a in args])


@pytest.mark.parametrize("tp", CE_TPS)
def test_vocab_parallel_cross_entropy_matches_torch(vm, tp):
    """Each rank's loss is F.cross_entropy of the full logits, and each rank's gradient
    (tp_reduce's backward the identity, tp_max's none) its slice of softmax - one_hot / R."""
    rng = np.random.default_rng(tp)
    logits = (3 * rng.standard_normal((ROWS, CLASSES))).astype(F32)
    target = rng.integers(0, CLASSES, ROWS).astype("int64")
    target[:tp] = np.arange(tp) * (CLASSES // tp) + CLASSES // tp - 1  # a target on each rank
    pieces = np.split(logits, tp, axis=1)
    out = _run(vm, f"ce_{tp}", [a for piece in pieces for a in (piece, target)])
    ref = torch.tensor(logits, requires_grad=True)
    loss = F.cross_entropy(ref, torch.tensor(target))
    loss.backward()
    expected_grad = (torch.softmax(ref.detach(), -1)
                     - F.one_hot(torch.tensor(target), CLASSES)) / ROWS
    np.testing.assert_allclose(ref.grad.numpy(), expected_grad.numpy(), rtol=1e-5, atol=1e-7)
    for r in range(tp):
        value, (grad,) = out[r]
        np.testing.assert_allclose(value.numpy(), loss.item(), rtol=1e-5)
        np.testing.assert_allclose(grad.numpy(), np.split(ref.grad.numpy(), tp, axis=1)[r],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tp", LM_TPS)
def test_sharded_tied_lm_matches_torch(vm, tp):
    """The whole step's values: shard_forward's vocabulary-parallel lookup and head, the
    vocabulary-parallel loss, and autodiff through f / g. Every rank's loss is the full
    model's; its table gradient is its rows of the full one (the lookup's and the head's
    contributions); the replicated norm's gradients are whole on every rank (f sums the
    partial gradients of the hidden state)."""
    rng = np.random.default_rng(10 + tp)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int64")
    ids[0, :tp] = np.arange(tp) * (VOCAB // tp)  # an id in each rank's range
    target = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int64")
    wte = rng.standard_normal((VOCAB, DIM)).astype(F32)
    ln_w = (1 + 0.1 * rng.standard_normal(DIM)).astype(F32)
    ln_b = (0.1 * rng.standard_normal(DIM)).astype(F32)
    plan = vocab_plan(lm_forward(), tp, TIED)
    args = []
    for r in range(tp):
        args += [ids, plan.local_shard("wte", wte, r), ln_w, ln_b, target]
    out = _run(vm, f"lm_{tp}", args)

    tw, tg, tb = (torch.tensor(a, requires_grad=True) for a in (wte, ln_w, ln_b))
    h = F.layer_norm(tw[torch.tensor(ids)], (DIM,), tg, tb, eps=1e-5)
    loss = F.cross_entropy((h @ tw.T).reshape(-1, VOCAB), torch.tensor(target).reshape(-1))
    loss.backward()
    pieces = []
    for r in range(tp):
        value, (g_wte, g_w, g_b) = out[r]
        np.testing.assert_allclose(value.numpy(), loss.item(), rtol=1e-5)
        np.testing.assert_allclose(g_w.numpy(), tg.grad.numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(g_b.numpy(), tb.grad.numpy(), rtol=1e-4, atol=1e-6)
        pieces.append(g_wte.numpy())
    np.testing.assert_allclose(plan.assemble("wte", pieces), tw.grad.numpy(), rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("case", list(PADDED_LMS))
def test_padded_lm_matches_torch_and_its_padding_gets_no_gradient(vm, case):
    """A vocabulary T does not divide, padded: every rank's loss is the unpadded model's
    (the masked classes add nothing to the sum of exponentials, even on a rank holding only
    padding), the real rows' gradients are PyTorch's and the padded rows' exactly zero, so no
    optimizer ever moves them."""
    vocab, tp, tied = PADDED_LMS[case]
    names = TIED if tied else UNTIED
    plan = vocab_plan(lm_forward(vocab=vocab, tied=tied), tp, names)
    assert set(plan.padding) == set(plan.placements) == {"wte"} | (set() if tied else
                                                                  {"head.weight"})
    rng = np.random.default_rng(vocab + tp)
    ids = rng.integers(0, vocab, (BATCH, SEQ)).astype("int64")
    target = rng.integers(0, vocab, (BATCH, SEQ)).astype("int64")
    ids[0, 0] = target[0, 0] = vocab - 1  # the last real class, next to the padding
    full = {"wte": rng.standard_normal((vocab, DIM)).astype(F32),
            "ln.weight": (1 + 0.1 * rng.standard_normal(DIM)).astype(F32),
            "ln.bias": (0.1 * rng.standard_normal(DIM)).astype(F32),
            "head.weight": rng.standard_normal((vocab, DIM)).astype(F32)}
    args = []
    for r in range(tp):
        args += [ids, *(plan.local_shard(n, full[n], r) for n in names), target]
    out = _run(vm, case, args)

    t = {n: torch.tensor(full[n], requires_grad=True) for n in names}
    h = F.layer_norm(t["wte"][torch.tensor(ids)], (DIM,), t["ln.weight"], t["ln.bias"])
    logits = h @ t["wte" if tied else "head.weight"].T
    loss = F.cross_entropy(logits.reshape(-1, vocab), torch.tensor(target).reshape(-1))
    loss.backward()
    grads = [out[r][1] for r in range(tp)]
    for r in range(tp):
        np.testing.assert_allclose(out[r][0].numpy(), loss.item(), rtol=1e-5)
    for i, name in enumerate(names):
        pieces = [g[i].numpy() for g in grads]
        if name in plan.padding:
            np.testing.assert_array_equal(np.concatenate(pieces)[vocab:], 0)
            got = plan.assemble(name, pieces)
        else:
            got = pieces[0]
        np.testing.assert_allclose(got, t[name].grad.numpy(), rtol=1e-4, atol=1e-6)
