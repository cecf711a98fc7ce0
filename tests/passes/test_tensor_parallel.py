"""IR tier for tensor parallelism (DESIGN.md 3b and 6): plan_tensor_parallel (which parameters
split, and why the others stay whole), shard_forward (Before / Expected, structural equality),
the collectives a split train step holds before and after LowerTensorParallel, and
TensorParallelPlan's local_shard / assemble / explain. Single process, no MPI."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import raf_dist
from raf_dist.passes.tensor_parallel import plan_tensor_parallel
from raf_dist.passes.tp_plan import Placement, TensorParallelPlan
from raf_dist.passes.tp_shard import shard_forward
from raf_dist.passes.tp_ops import TP_COPY, TP_REDUCE, LowerTensorParallel, tp_copy, tp_reduce
from raf_dist.passes.tp_padding import Padding
from raf_dist.training.tensor_parallel import make_plan, shard_model

from models import MLP, TransformerBlock, make_sharded_rec

F32 = "float32"
ROWS = 4


# ---- helpers -----------------------------------------------------------------------------
def bindings(func):
    """(var, value) of every binding, in order (the functions here are normalized: every call
    is bound, so this sees every call)."""
    return [(b.var, b.value) for block in func.body.blocks for b in block.bindings]


def op_calls(func, op_name):
    return [(var, value) for var, value in bindings(func)
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == op_name]


def packed_calls(func, symbol):
    return [value for _, value in bindings(func)
            if isinstance(value, relax.Call) and isinstance(value.op, relax.ExternFunc)
            and str(value.op.global_symbol) == symbol]


def shape_of(expr):
    return tuple(int(d) for d in expr.ty.shape)


def linear(bb, x, weight, bias):
    """nn.Linear as from_pytorch emits it: permute_dims(weight), matmul, add(bias, mm)."""
    wt = bb.emit(relax.op.permute_dims(weight, axes=[1, 0]))
    mm = bb.emit(relax.op.matmul(x, wt, out_dtype=F32))
    return bb.emit(relax.op.add(bias, mm))


def tensor(name, *shape):
    return relax.Var(name, relax.TensorType(shape, F32))


def mlp_forward(d_in=20, hidden=32, d_out=8, tp=1, prescale=False, sharded=False):
    """x -> [x * p_scale] -> Linear(d_in, hidden) -> relu -> Linear(hidden, d_out).

    ``sharded``: the function shard_forward should make of it at ``tp`` ranks: the first layer
    column parallel (weight rows and bias split), the second row parallel (weight columns
    split) with g (tp_reduce) on its partial matmul, before its replicated bias; f (tp_copy) on
    the first layer's input only when a gradient flows to it (``prescale``: it is computed from
    a trained parameter; the data ``x`` needs none)."""
    h = hidden // tp if sharded else hidden
    x = tensor("x", ROWS, d_in)
    params = ([tensor("p_scale", d_in)] if prescale else []) + [
        tensor("p_layers_0_weight", h, d_in), tensor("p_layers_0_bias", h),
        tensor("p_layers_1_weight", d_out, h), tensor("p_layers_1_bias", d_out)]
    bb = relax.BlockBuilder()
    with bb.function("forward", [x, *params], attrs={"num_input": 1}, pure=True):
        with bb.dataflow():
            inp = x
            if prescale:
                inp = bb.emit(relax.op.multiply(x, params[0]))
            w0, b0, w1, b1 = params[-4:]
            wt = bb.emit(relax.op.permute_dims(w0, axes=[1, 0]))
            if sharded and prescale:
                inp = bb.emit(tp_copy(inp))
            mm = bb.emit(relax.op.matmul(inp, wt, out_dtype=F32))
            y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(b0, mm))))
            wt = bb.emit(relax.op.permute_dims(w1, axes=[1, 0]))
            mm = bb.emit(relax.op.matmul(y, wt, out_dtype=F32))
            if sharded:
                mm = bb.emit(tp_reduce(mm))
            out = bb.emit(relax.op.add(b1, mm))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()["forward"]


MLP_NAMES = ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]


def find_plan(model, tp, plan=None):
    """The plan found (or checked, ``plan``) on a captured model, every parameter trained; the
    logits stay whole (no vocabulary-parallel loss)."""
    names = list(model.param_names)
    return plan_tensor_parallel(model.forward, tp, names, names, plan=plan)


def split_model(model, tp, plan=None, rank=0):
    plan = plan or find_plan(model, tp)
    return plan, shard_model(model, plan, rank, model.init_params)


# ---- models, captured once -----------------------------------------------------------------
# A vocabulary of 12 < the 16 ids a step looks up: the token table is not worth splitting
# (vocabulary parallelism is tested elsewhere), so what splits here is the block itself.
VOCAB = 12


def _block(heads):
    torch.manual_seed(0)
    return raf_dist.frontend.from_pytorch(TransformerBlock(vocab=VOCAB, heads=heads),
                                          (torch.randint(0, VOCAB, (2, 8)),))


@pytest.fixture(scope="module")
def block4():
    return _block(4)


@pytest.fixture(scope="module")
def block2():
    return _block(2)


# ---- 1. column / row pair, Before / Expected -----------------------------------------------
def test_helper_builds_what_from_pytorch_captures():
    """The hand-built Before is the frontend's own pattern for two nn.Linear, so the
    Before/Expected tests below exercise what users' models give the pass."""
    torch.manual_seed(0)
    model = raf_dist.frontend.from_pytorch(MLP((20, 32, 8)), (torch.randn(ROWS, 20),))
    assert list(model.param_names) == MLP_NAMES
    tvm.ir.assert_structural_equal(model.forward, mlp_forward())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("prescale", [False, True], ids=["data-input", "param-input"])
def test_column_row_pair(tp, prescale):
    before = mlp_forward(prescale=prescale)
    names = (["scale"] if prescale else []) + MLP_NAMES
    plan = plan_tensor_parallel(before, tp, names, names)
    assert plan.placements == {
        "layers.0.weight": Placement(0, 1, "colwise"), "layers.0.bias": Placement(0, 1, "bias"),
        "layers.1.weight": Placement(1, 1, "rowwise")}
    assert set(plan.replicated) == set(names) - set(plan.placements)
    assert plan.forward_reduces == [ROWS * 8]
    # f only when a gradient flows into the region's input (x * scale), of its size
    assert plan.backward_reduces == ([ROWS * 20] if prescale else [])
    after = shard_forward(before, tp, names, names, plan)
    tvm.ir.assert_structural_equal(after, mlp_forward(tp=tp, prescale=prescale, sharded=True))
    assert len(op_calls(after, TP_COPY)) == (1 if prescale else 0)
    assert len(op_calls(after, TP_REDUCE)) == 1


def test_frozen_prescale_needs_no_copy():
    """The same graph with the scale frozen: nothing upstream of the region wants a gradient,
    so no f (and no backward allreduce)."""
    before = mlp_forward(prescale=True)
    names = ["scale"] + MLP_NAMES
    plan = plan_tensor_parallel(before, 2, names, MLP_NAMES)
    assert plan.backward_reduces == []
    after = shard_forward(before, 2, names, MLP_NAMES, plan)
    assert op_calls(after, TP_COPY) == []
    assert len(op_calls(after, TP_REDUCE)) == 1


def test_two_column_layers_on_one_input_share_one_copy():
    """gate/up style: two column layers read the same parameter-derived value; f wraps it once
    and both matmuls read that copy."""
    x = tensor("x", ROWS, 20)
    names = ["scale", "a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"]
    shapes = [(20,), (32, 20), (32,), (32, 20), (32,), (8, 32), (8,)]
    params = [tensor("p_" + n.replace(".", "_"), *s) for n, s in zip(names, shapes)]
    scale, wa, ba, wb, bb_, wc, bc = params
    bb = relax.BlockBuilder()
    with bb.function("forward", [x, *params], attrs={"num_input": 1}, pure=True):
        with bb.dataflow():
            h = bb.emit(relax.op.multiply(x, scale))
            a = bb.emit(relax.op.nn.silu(linear(bb, h, wa, ba)))
            b = linear(bb, h, wb, bb_)
            gv = bb.emit_output(linear(bb, bb.emit(relax.op.multiply(a, b)), wc, bc))
        bb.emit_func_output(gv)
    before = bb.get()["forward"]
    plan = plan_tensor_parallel(before, 4, names, names)
    assert {n: p.role for n, p in plan.placements.items()} == {
        "a.weight": "colwise", "a.bias": "bias", "b.weight": "colwise", "b.bias": "bias",
        "c.weight": "rowwise"}
    assert plan.backward_reduces == [ROWS * 20] and plan.forward_reduces == [ROWS * 8]
    after = shard_forward(before, 4, names, names, plan)
    copies = op_calls(after, TP_COPY)
    assert len(copies) == 1
    copy_var = copies[0][0]
    readers = [v for v, value in op_calls(after, "relax.matmul") if value.args[0].same_as(copy_var)]
    assert len(readers) == 2
    assert shape_of(after.params[2]) == (8, 20) and shape_of(after.params[6]) == (8, 8)


# ---- 2. dimensions that do not divide --------------------------------------------------------
def test_indivisible_dimension_stays_replicated_with_reason():
    before = mlp_forward(hidden=30)
    plan = plan_tensor_parallel(before, 4, MLP_NAMES, MLP_NAMES)
    assert plan.placements == {}
    why = plan.replicated["layers.0.weight"]
    assert "30" in why and "4" in why, why
    assert set(plan.replicated) == set(MLP_NAMES)
    assert plan.forward_reduces == [] and plan.backward_reduces == []
    after = shard_forward(before, 4, MLP_NAMES, MLP_NAMES, plan)
    tvm.ir.assert_structural_equal(after, before)
    # divides by 2: split there
    assert "layers.0.weight" in plan_tensor_parallel(before, 2, MLP_NAMES, MLP_NAMES).placements


def test_explicit_colwise_on_indivisible_dimension_raises():
    before = mlp_forward(hidden=30)
    with pytest.raises(ValueError, match=r"layers\.0\.weight.*30"):
        plan_tensor_parallel(before, 4, MLP_NAMES, MLP_NAMES,
                             plan={"layers.0": "colwise", "layers.1": "rowwise"})


def test_tables_sharded_over_dp_stay_whole_on_every_tp_rank():
    """embedding_parallel beside tensor parallelism: the auto plan would split the embedding
    tables along their rows (vocabulary parallel); ``keep_whole`` leaves them to the dp
    sharding and still splits the MLPs; a user plan that splits one is refused by name."""
    from raf_dist.training import embedding_parallel as ep_lib

    module, x, _ = make_sharded_rec(8)
    model = raf_dist.frontend.from_pytorch(module, x)
    tables = ep_lib.table_names(model)
    assert set(tables) == {"tables.0.weight", "tables.1.weight", "tables.2.weight",
                           "category.weight"}
    assert set(tables) & set(make_plan(model, 2).placements)  # what keep_whole prevents
    plan = make_plan(model, 2, keep_whole=tables)
    assert not set(tables) & set(plan.placements), plan.placements
    assert {"bottom.0.weight", "top.0.weight", "top.2.weight"} <= set(plan.placements)
    with pytest.raises(ValueError, match="'category.weight' is planned 'rowwise', but it is an "
                                         "embedding table"):
        make_plan(model, 2, {"category.weight": "rowwise"}, keep_whole=tables)


def test_an_inner_layer_is_not_padded_only_an_output_head():
    """A vocabulary (here a head of 9 classes at T = 4) is padded to a multiple of T:
    its padded logits are masked and never reach a real value. An inner layer's would feed
    the next layer (its padded activations there get gradients), so hidden 30 stays whole."""
    before = mlp_forward(hidden=30, d_out=9)
    plan = plan_tensor_parallel(before, 4, MLP_NAMES, MLP_NAMES, split_output=True)
    assert plan.padding == {"layers.1.weight": Padding(0, 9, 12),
                            "layers.1.bias": Padding(0, 9, 12)}
    assert {n: p.role for n, p in plan.placements.items()} == {
        "layers.1.weight": "colwise", "layers.1.bias": "bias"}
    assert "30" in plan.replicated["layers.0.weight"]
    assert plan.output_split and plan.output_classes == 9


def test_later_layer_splits_when_the_first_does_not_divide():
    """MLP (20, 30, 32, 5) at T = 4: layer 0 (30) whole, layers 1/2 column/row."""
    torch.manual_seed(0)
    model = raf_dist.frontend.from_pytorch(MLP((20, 30, 32, 5)), (torch.randn(ROWS, 20),))
    plan = make_plan(model, 4)
    assert {n: p.role for n, p in plan.placements.items()} == {
        "layers.1.weight": "colwise", "layers.1.bias": "bias", "layers.2.weight": "rowwise"}
    assert "30" in plan.replicated["layers.0.weight"]
    # relu(layer 0) feeds the region and needs a gradient (layer 0 is trained): one f
    assert plan.backward_reduces == [ROWS * 30] and plan.forward_reduces == [ROWS * 5]


# ---- 3. attention block ----------------------------------------------------------------------
BLOCK_SPLIT = {"qkv.weight": ("colwise", 0, 3), "proj.weight": ("rowwise", 1, 1),
               "fc1.weight": ("colwise", 0, 1), "fc1.bias": ("bias", 0, 1),
               "fc2.weight": ("rowwise", 1, 1)}


@pytest.mark.parametrize("tp", [2, 4])
def test_transformer_block_plan_and_sharded_forward(block4, tp):
    plan, sharded = split_model(block4, tp)
    got = {n: (p.role, p.dim, p.segments) for n, p in plan.placements.items()}
    assert got == BLOCK_SPLIT
    assert set(plan.replicated) == set(block4.param_names) - set(BLOCK_SPLIT)
    assert all(plan.replicated[n] for n in plan.replicated)
    tokens = 2 * 8 * 16  # batch x seq x hidden per allreduce
    assert plan.forward_reduces == [tokens] * 2 and plan.backward_reduces == [tokens] * 2
    fwd = sharded.forward
    assert len(op_calls(fwd, TP_REDUCE)) == 2
    assert len(op_calls(fwd, TP_COPY)) == 2
    # every collective carries batch x seq x hidden elements
    for _, call in op_calls(fwd, TP_REDUCE) + op_calls(fwd, TP_COPY):
        assert int(np.prod(shape_of(call.args[0]))) == tokens
    # local shapes of the arguments and of the loaded pieces agree
    params = dict(zip(block4.param_names, fwd.params[-len(block4.param_names):]))
    for name, full in plan.shapes.items():
        local = list(full)
        if name in plan.placements:
            local[plan.placements[name].dim] //= tp
        assert shape_of(params[name]) == tuple(local), name
        assert sharded.init_params[name].shape == tuple(local), name
    # a re-capture's pieces without values (training/tensor_parallel.py): the same shapes,
    # computed, no memory
    shapes_only = shard_model(block4, plan, 0, block4.init_params, values=False)
    for name, value in shapes_only.init_params.items():
        assert value.shape == sharded.init_params[name].shape and value.strides == (0,) * value.ndim


def _classify_reduces(step):
    """forward (g after a row-parallel matmul: its argument is a matmul's partial result),
    guard (the non-finite verdict: a 0-d flag), backward (the rest: the gradient Gradient
    emits for each f, whose argument is the copy's adjoint)."""
    produced = dict(bindings(step))
    kinds = []
    for _, call in op_calls(step, TP_REDUCE):
        arg = call.args[0]
        src = produced.get(arg)
        if len(arg.ty.shape) == 0:
            kinds.append("guard")
        elif isinstance(src, relax.Call) and getattr(src.op, "name", "") == "relax.matmul":
            kinds.append("forward")
        else:
            kinds.append("backward")
    return kinds


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("guard", [None, "gradients"])
def test_transformer_block_train_step_collectives(block4, tp, guard):
    _, sharded = split_model(block4, tp)
    mod, _ = raf_dist.training.build_train_step(sharded, "cross_entropy",
                                                raf_dist.optim.SGD(lr=0.1),
                                                nonfinite_guard=guard, tensor_parallel=True)
    step = mod["train_step"]
    kinds = _classify_reduces(step)
    expected = ["forward"] * 2 + ["backward"] * 2 + (["guard"] if guard else [])
    assert kinds == expected  # in this order: forward, then backward, then the verdict
    assert len(op_calls(step, TP_COPY)) == 2
    lowered = LowerTensorParallel(group=0)(mod)["train_step"]
    assert op_calls(lowered, TP_COPY) == []
    assert op_calls(lowered, TP_REDUCE) == []
    allreduces = packed_calls(lowered, "raf_dist.ccl.allreduce")
    assert len(allreduces) == len(expected)
    for call in allreduces:
        assert int(call.args[2].value) == 0  # the tp group
        assert str(call.args[1].value) == "sum"


def test_lower_tensor_parallel_uses_the_given_group(block4):
    _, sharded = split_model(block4, 2)
    mod, _ = raf_dist.training.build_train_step(sharded, "cross_entropy",
                                                raf_dist.optim.SGD(lr=0.1), tensor_parallel=True)
    lowered = LowerTensorParallel(group=3)(mod)["train_step"]
    groups = [int(c.args[2].value) for c in packed_calls(lowered, "raf_dist.ccl.allreduce")]
    assert groups == [3] * 4


# ---- 4. heads that do not divide -------------------------------------------------------------
def test_indivisible_heads_keep_attention_replicated(block2):
    plan, sharded = split_model(block2, 4)
    assert {n: p.role for n, p in plan.placements.items()} == {
        "fc1.weight": "colwise", "fc1.bias": "bias", "fc2.weight": "rowwise"}
    assert "reshape" in plan.replicated["qkv.weight"], plan.replicated["qkv.weight"]
    assert "proj.weight" in plan.replicated
    assert len(op_calls(sharded.forward, TP_REDUCE)) == 1
    assert len(op_calls(sharded.forward, TP_COPY)) == 1
    # the same block splits its 2 heads over 2 ranks
    assert "qkv.weight" in find_plan(block2, 2).placements


# ---- 5. explicit plans -----------------------------------------------------------------------
MLP_ONLY = {"fc1.weight": "colwise", "fc1.bias": "bias", "fc2.weight": "rowwise"}


def test_explicit_plan_over_module_names_splits_only_what_it_names(block4):
    plan = find_plan(block4, 2, {"fc1": "colwise", "fc2": "rowwise"})
    assert {n: p.role for n, p in plan.placements.items()} == MLP_ONLY
    assert plan.replicated["qkv.weight"] == "not in the plan"


def test_explicit_plan_over_parameter_names_splits_only_what_it_names(block4):
    plan = find_plan(block4, 2, {"fc1": "colwise", "fc2.weight": "rowwise"})
    assert {n: p.role for n, p in plan.placements.items()} == MLP_ONLY
    assert plan.replicated["qkv.weight"] and plan.replicated["proj.weight"]
    assert len(plan.forward_reduces) == 1 and len(plan.backward_reduces) == 1
    _, sharded = split_model(block4, 2, plan)
    assert len(op_calls(sharded.forward, TP_REDUCE)) == 1
    assert len(op_calls(sharded.forward, TP_COPY)) == 1


def test_explicit_plan_that_cannot_hold_raises(block4):
    """fc1 column parallel needs its bias split too; the plan keeps it whole."""
    with pytest.raises(ValueError, match=r"fc1\.weight.*fc1\.bias is to stay replicated"):
        find_plan(block4, 2, {"fc1.weight": "colwise", "fc*.bias": "replicate",
                              "fc2.weight": "rowwise"})


def test_explicit_plan_unknown_pattern_lists_names(block4):
    with pytest.raises(ValueError, match=r"'nope\*'.*matches no parameter.*pos.*tok\.weight"):
        find_plan(block4, 2, {"nope*": "colwise"})


def test_explicit_plan_bad_value_names_allowed(block4):
    with pytest.raises(ValueError, match=r"colwise.*rowwise.*replicate") as err:
        find_plan(block4, 2, {"fc1": "column"})
    assert "'column'" in str(err.value)


def test_explicit_rowwise_without_colwise_raises(block4):
    with pytest.raises(ValueError, match=r"fc2\.weight.*rowwise"):
        find_plan(block4, 2, {"fc2": "rowwise"})


def test_explicit_replicate_overrides_the_search(block4):
    plan = find_plan(block4, 2, {"qkv": "colwise", "proj.weight": "rowwise", "fc1": "replicate"})
    assert {n: p.role for n, p in plan.placements.items()} == {
        "qkv.weight": "colwise", "proj.weight": "rowwise"}
    assert plan.replicated["fc1.weight"] == "replicated by the plan"


# ---- 6. local_shard / assemble -----------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_local_shard_assemble_round_trip(tp):
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((48, 16)).astype(F32)
    fc2 = rng.standard_normal((16, 64)).astype(F32)
    plan = TensorParallelPlan(tp, {"qkv": Placement(0, 3, "colwise"),
                                   "fc2": Placement(1, 1, "rowwise")},
                              {"bias": "why"}, {"qkv": (48, 16), "fc2": (16, 64), "bias": (16,)},
                              [], [])
    seg = 48 // 3
    pieces = [plan.local_shard("qkv", qkv, r) for r in range(tp)]
    for r, piece in enumerate(pieces):
        assert piece.shape == (48 // tp, 16)
        want = np.concatenate([qkv[s * seg + r * seg // tp: s * seg + (r + 1) * seg // tp]
                               for s in range(3)])
        np.testing.assert_array_equal(piece, want)
    np.testing.assert_array_equal(plan.assemble("qkv", pieces), qkv)

    pieces = [plan.local_shard("fc2", fc2, r) for r in range(tp)]
    for r, piece in enumerate(pieces):
        np.testing.assert_array_equal(piece, fc2[:, r * 64 // tp:(r + 1) * 64 // tp])
    np.testing.assert_array_equal(plan.assemble("fc2", pieces), fc2)

    bias = rng.standard_normal(16).astype(F32)
    assert plan.local_shard("bias", bias, tp - 1) is bias
    np.testing.assert_array_equal(plan.assemble("bias", [bias] * tp), bias)


@pytest.mark.parametrize("tp", [2, 4])
def test_found_plan_shards_qkv_per_segment(block4, tp):
    """The plan found on the block cuts q, k and v each T ways (piece r holds heads
    [r H/T, (r+1) H/T) of each), not the fused weight in T contiguous blocks."""
    plan = find_plan(block4, tp)
    qkv = np.arange(48 * 16, dtype=F32).reshape(48, 16)
    pieces = [plan.local_shard("qkv.weight", qkv, r) for r in range(tp)]
    q, k, v = np.split(qkv, 3)
    for r, piece in enumerate(pieces):
        want = np.concatenate([t[r * 16 // tp:(r + 1) * 16 // tp] for t in (q, k, v)])
        np.testing.assert_array_equal(piece, want)
    np.testing.assert_array_equal(plan.assemble("qkv.weight", pieces), qkv)


# ---- 7. explain ------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_explain(block4, tp):
    plan = find_plan(block4, tp)
    text = plan.explain()
    lines = text.splitlines()
    for name in block4.param_names:
        assert any(line.split() and line.split()[0] == name for line in lines), name
    assert f"T = {tp}" in text
    nbytes = 2 * (2 * 8 * 16) * 4
    bus = 2 * (tp - 1) / tp * nbytes
    for kind in ("forward", "backward"):
        line = next(line for line in lines if line.strip().startswith(kind + ":"))
        assert "2 allreduce" in line, line
        assert f"{nbytes} bytes" in line and f"{bus:.0f} bus bytes" in line, line
    # the reasons for what stays whole are shown
    assert plan.replicated["head.weight"] in text
    # itemsize scales the bytes (bfloat16)
    assert f"{nbytes // 2} bytes" in plan.explain(itemsize=2)


# ---- 8. Hugging Face Llama ---------------------------------------------------------------------
def test_hf_llama_plan():
    pytest.importorskip("transformers")
    from hf import hf_model

    model = raf_dist.frontend.from_pytorch(hf_model("llama"), (torch.randint(0, 64, (2, 8)),))
    plan, sharded = split_model(model, 2)
    roles = {n: p.role for n, p in plan.placements.items() if ".layers." in n}
    expected = {}
    for layer in range(2):
        pre = f"model.model.layers.{layer}."
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            expected[pre + proj + ".weight"] = "colwise"
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            expected[pre + proj + ".weight"] = "rowwise"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert pre + norm + ".weight" in plan.replicated
    assert roles == expected
    assert "model.lm_head.weight" in plan.replicated  # the logits stay whole
    assert plan.shapes["model.model.layers.0.self_attn.k_proj.weight"] == (16, 32)  # 2 kv heads
    tokens = 2 * 8 * 32
    # 2 per layer each way; a vocabulary-parallel token table (if split) adds one forward g
    vocab = 1 if "model.model.embed_tokens.weight" in plan.placements else 0
    assert plan.backward_reduces == [tokens] * 4
    assert plan.forward_reduces.count(tokens) == 4 + vocab
    assert len(plan.forward_reduces) == 4 + vocab
    fwd = sharded.forward
    produced = dict(bindings(fwd))
    layer_reduces = [c for _, c in op_calls(fwd, TP_REDUCE)
                     if getattr(produced.get(c.args[0]), "op", None) is not None
                     and getattr(produced[c.args[0]].op, "name", "") == "relax.matmul"]
    assert len(layer_reduces) == 4
    assert len(op_calls(fwd, TP_REDUCE)) == 4 + vocab
    assert len(op_calls(fwd, TP_COPY)) == 4
    k = sharded.init_params["model.model.layers.1.self_attn.k_proj.weight"]
    assert k.shape == (8, 32)
