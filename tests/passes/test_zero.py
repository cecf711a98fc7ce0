"""IR tier for ShardZeRO (ZeRO-1/2/3): TVMScript Before / Expected for a step whose
parameters do not divide by N (3 elements on 2 ranks) or are smaller than N (1 element), and
properties of the pass on a real training step for every level and N = 1 to 4. No MPI."""
import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import raf_dist
from models import MLP, make, make_sharded_rec, raf_optimizer
from raf_dist.passes import ShardZeRO, gradient_buckets, shard_size
from raf_dist.passes.gradient_markers import find_markers
from raf_dist.training import build_train_step


@I.ir_module
class Before:
    @R.function
    def train_step(x: R.Tensor((3,), "float32"), w1: R.Tensor((3,), "float32"),
                   w2: R.Tensor((1,), "float32"), w1_buf: R.Tensor((3,), "float32"),
                   w2_buf: R.Tensor((1,), "float32"), lr: R.Tensor((), "float32")):
        R.func_attr({"raf_dist.param_offset": 1, "raf_dist.num_params": 2,
                     "raf_dist.states_per_param": 1})
        with R.dataflow():
            y = R.multiply(x, w1)
            loss = R.sum(R.multiply(y, w2))
            g2 = R.sum(y, axis=[0], keepdims=True)  # backward produces w2's gradient first
            m2 = R.call_pure_packed("raf_dist.mark_gradient", g2, R.prim_value(1),
                                    ty_args=R.Tensor((1,), "float32"))
            g1 = R.multiply(x, w2)
            m1 = R.call_pure_packed("raf_dist.mark_gradient", g1, R.prim_value(0),
                                    ty_args=R.Tensor((3,), "float32"))
            b1 = R.add(R.multiply(w1_buf, R.const(0.9, "float32")), m1)
            new_w1 = R.subtract(w1, R.multiply(b1, lr))
            b2 = R.add(R.multiply(w2_buf, R.const(0.9, "float32")), m2)
            new_w2 = R.subtract(w2, R.multiply(b2, lr))
            out = (loss, new_w1, new_w2, b1, b2)
            R.output(out)
        return out


# Level 2 with overlap, one bucket holding both gradients (backward order: w2 then w1). One
# reduce_scatter (avg) reads both gradients where backward computed them (no packed copy of
# the bucket) and leaves each rank its shard of each, back to back in one flat [S] buffer,
# S = ceil(1/2) + ceil(3/2); the momentum update runs once on it (w2's chain, since every
# parameter's is the same), local_shard cuts this rank's parameter shard at run time; the
# updated shards are all-gathered straight into w2 and w1 (padding dropped by the collective),
# and the step returns the parameter arguments themselves; optimizer state is one flat [S]
# shard for the bucket.
@I.ir_module
class ExpectedLevel2Overlap:
    @R.function(pure=False)
    def train_step(x: R.Tensor((3,), dtype="float32"), w1: R.Tensor((3,), dtype="float32"), w2: R.Tensor((1,), dtype="float32"), bucket0__state0: R.Tensor((3,), dtype="float32"), lr: R.Tensor((), dtype="float32")) -> R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32")):
        R.func_attr({"raf_dist.num_params": 2, "raf_dist.param_offset": 1, "raf_dist.states_per_param": 1, "raf_dist.updated_arguments": [1, 2, 3], "raf_dist.zero_level": 2})
        with R.dataflow():
            y: R.Tensor((3,), dtype="float32") = R.multiply(x, w1)
            lv1: R.Tensor((3,), dtype="float32") = R.multiply(y, w2)
            loss: R.Tensor((), dtype="float32") = R.sum(lv1, axis=None, keepdims=False)
            g2: R.Tensor((1,), dtype="float32") = R.sum(y, axis=[0], keepdims=True)
            g1: R.Tensor((3,), dtype="float32") = R.multiply(x, w2)
            grad_shard0: R.Tensor((3,), dtype="float32") = R.builtin.alloc_tensor(R.shape([3]), R.dtype("float32"), 0, R.str("global"))
            R.output(loss, g2, g1, grad_shard0)
        # shard r = [shard r of g2 (s = 1), shard r of g1 (s = 2)], zeros past a tensor's end
        reduce_scatter0_handle: R.Prim("int64") = R.call_packed("raf_dist.ccl.reduce_scatter_start", g2, g1, R.str("avg"), 0, grad_shard0, ty_args=R.Prim("int64"))
        # the wait names the gradients: the planner keeps them until the collective is done
        R.call_packed("raf_dist.ccl.wait", reduce_scatter0_handle, g2, g1, grad_shard0, ty_args=(R.Tuple,))
        with R.dataflow():
            param_shard0 = R.call_dps_packed("raf_dist.ccl.local_shard", (w2, w1, 0), out_ty=R.Tensor((3,), dtype="float32"))
            lv11_b0: R.Tensor((3,), dtype="float32") = R.multiply(bucket0__state0, R.const(0.89999997615814209, "float32"))
            b2_b0: R.Tensor((3,), dtype="float32") = R.add(lv11_b0, grad_shard0)
            lv13_b0: R.Tensor((3,), dtype="float32") = R.multiply(b2_b0, lr)
            new_w2_b0: R.Tensor((3,), dtype="float32") = R.subtract(param_shard0, lv13_b0)
            R.output(b2_b0, new_w2_b0)
        allgather_updated0_handle: R.Prim("int64") = R.call_packed("raf_dist.ccl.allgather_start", new_w2_b0, 0, w2, w1, ty_args=R.Prim("int64"))
        R.call_packed("raf_dist.ccl.wait", allgather_updated0_handle, new_w2_b0, w2, w1, ty_args=(R.Tuple,))
        R.call_packed("raf_dist.ccl.allreduce", loss, R.str("avg"), 0, loss, ty_args=(R.Tuple,))
        step_outputs: R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((3,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32")) = loss, w1, w2, b2_b0
        return step_outputs


# Level 3 without overlap: parameters arrive as shards and are gathered (blocking), each
# straight into a full buffer of its own, before their first forward use; backward gathers
# again only what it reads (w2); the update returns shards.
@I.ir_module
class ExpectedLevel3Serial:
    @R.function(pure=False)
    def train_step(x: R.Tensor((3,), dtype="float32"), w1: R.Tensor((2,), dtype="float32"), w2: R.Tensor((1,), dtype="float32"), bucket0__state0: R.Tensor((3,), dtype="float32"), lr: R.Tensor((), dtype="float32")) -> R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((2,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32")):
        R.func_attr({"raf_dist.num_params": 2, "raf_dist.param_offset": 1, "raf_dist.states_per_param": 1, "raf_dist.updated_arguments": [1, 2, 3], "raf_dist.zero_level": 3})
        with R.dataflow():
            forward_gather0_shards = R.call_dps_packed("raf_dist.bucket.concat", (w1, w2), out_ty=R.Tensor((3,), dtype="float32"))
            forward_gather0_full0: R.Tensor((3,), dtype="float32") = R.builtin.alloc_tensor(R.shape([3]), R.dtype("float32"), 0, R.str("global"))
            forward_gather0_full1: R.Tensor((1,), dtype="float32") = R.builtin.alloc_tensor(R.shape([1]), R.dtype("float32"), 0, R.str("global"))
            R.output(forward_gather0_shards, forward_gather0_full0, forward_gather0_full1)
        R.call_packed("raf_dist.ccl.allgather", forward_gather0_shards, 0, forward_gather0_full0, forward_gather0_full1, ty_args=(R.Tuple,))
        with R.dataflow():
            y: R.Tensor((3,), dtype="float32") = R.multiply(x, forward_gather0_full0)
            lv1: R.Tensor((3,), dtype="float32") = R.multiply(y, forward_gather0_full1)
            loss: R.Tensor((), dtype="float32") = R.sum(lv1, axis=None, keepdims=False)
            g2: R.Tensor((1,), dtype="float32") = R.sum(y, axis=[0], keepdims=True)
            backward_gather0_full1: R.Tensor((1,), dtype="float32") = R.builtin.alloc_tensor(R.shape([1]), R.dtype("float32"), 0, R.str("global"))
            R.output(loss, g2, backward_gather0_full1)
        R.call_packed("raf_dist.ccl.allgather", w2, 0, backward_gather0_full1, ty_args=(R.Tuple,))
        with R.dataflow():
            g1: R.Tensor((3,), dtype="float32") = R.multiply(x, backward_gather0_full1)
            grad_shard0: R.Tensor((3,), dtype="float32") = R.builtin.alloc_tensor(R.shape([3]), R.dtype("float32"), 0, R.str("global"))
            R.output(g1, grad_shard0)
        R.call_packed("raf_dist.ccl.reduce_scatter", g2, g1, R.str("avg"), 0, grad_shard0, ty_args=(R.Tuple,))
        with R.dataflow():
            param_shards0: R.Tensor((3,), dtype="float32") = R.concat((w2, w1), axis=0)
            lv11_b0: R.Tensor((3,), dtype="float32") = R.multiply(bucket0__state0, R.const(0.89999997615814209, "float32"))
            b2_b0: R.Tensor((3,), dtype="float32") = R.add(lv11_b0, grad_shard0)
            lv13_b0: R.Tensor((3,), dtype="float32") = R.multiply(b2_b0, lr)
            new_w2_b0: R.Tensor((3,), dtype="float32") = R.subtract(param_shards0, lv13_b0)
            R.output(b2_b0, new_w2_b0)
        # outside the dataflow block: not fused with the update, so each shard can be written
        # into its parameter's buffer
        new_param0_parts: R.Tuple(R.Tensor((1,), dtype="float32"), R.Tensor((2,), dtype="float32")) = R.split(new_w2_b0, indices_or_sections=[1], axis=0)
        new_param0_shard1: R.Tensor((1,), dtype="float32") = new_param0_parts[0]
        new_param0_shard0: R.Tensor((2,), dtype="float32") = new_param0_parts[1]
        R.call_packed("raf_dist.ccl.allreduce", loss, R.str("avg"), 0, loss, ty_args=(R.Tuple,))
        step_outputs: R.Tuple(R.Tensor((), dtype="float32"), R.Tensor((2,), dtype="float32"), R.Tensor((1,), dtype="float32"), R.Tensor((3,), dtype="float32")) = loss, new_param0_shard0, new_param0_shard1, b2_b0
        return step_outputs


def test_level2_overlap_structure():
    after = ShardZeRO(2, 2, 1000, overlap=True)(Before)
    tvm.ir.assert_structural_equal(after, ExpectedLevel2Overlap)


def test_level3_serial_structure():
    after = ShardZeRO(3, 2, 1000, overlap=False)(Before)
    tvm.ir.assert_structural_equal(after, ExpectedLevel3Serial)


# ---- properties on real training steps --------------------------------------------------
def _step(model="mlp", optimizer="adamw", batch=4):
    module, x, _ = make(model, batch)
    mod, signature = build_train_step(raf_dist.frontend.from_pytorch(module, (x,)),
                                      "cross_entropy", raf_optimizer(optimizer))
    return mod, signature


def _calls(func, name):
    """Positions (in binding order) of packed calls to ``name``, blocking or started."""
    out = []
    bindings = [b for block in func.body.blocks for b in block.bindings]
    for i, binding in enumerate(bindings):
        value = binding.value
        if isinstance(value, relax.Call) and isinstance(value.op, relax.ExternFunc):
            if value.op.global_symbol in (name, name + "_start"):
                out.append(i)
    return out, bindings


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_shapes_and_collective_counts(level, world_size, overlap):
    mod, signature = _step()
    bucket_bytes = 500
    buckets = gradient_buckets(mod, bucket_bytes)
    assert len(buckets) >= 3
    func = ShardZeRO(level, world_size, bucket_bytes, overlap=overlap)(mod)["train_step"]
    n_in = 2  # x, target
    numels = [int(np.prod(shape)) for shape, _ in signature.param_specs]
    shards = [shard_size(n, world_size) for n in numels]
    params = func.params[n_in:n_in + len(numels)]
    states = func.params[n_in + len(numels):n_in + len(numels) + 2 * len(buckets)]
    for p, (shape, _), s in zip(params, signature.param_specs, shards):
        expected = (s,) if level == 3 else tuple(shape)
        assert tuple(int(d) for d in p.ty.shape) == expected, p.name
    # Adam: exp_avg and exp_avg_sq as one flat shard per bucket, bucket-major
    expected_states = [(sum(shards[k] for k in b),) for b in buckets for _ in range(2)]
    assert [tuple(int(d) for d in st.ty.shape) for st in states] == expected_states
    assert len(func.params) == n_in + len(numels) + 2 * len(buckets) + 3  # + Adam(W) scalars
    outputs = func.ret_ty.fields
    assert [tuple(int(d) for d in t.shape) for t in outputs[1:1 + len(numels)]] == [
        (s,) if level == 3 else tuple(shape) for (shape, _), s in zip(signature.param_specs, shards)]
    reduce_scatters, _ = _calls(func, "raf_dist.ccl.reduce_scatter")
    allgathers, _ = _calls(func, "raf_dist.ccl.allgather")
    assert len(reduce_scatters) == len(buckets)
    if level < 3:
        assert len(allgathers) == len(buckets)  # the updated shards, one per bucket
    else:  # forward gathers every parameter, backward what it reads
        assert len(allgathers) > len(gradient_buckets(mod, bucket_bytes)) // 2
    waits, _ = _calls(func, "raf_dist.ccl.wait")
    assert len(waits) == (len(reduce_scatters) + len(allgathers) if overlap else 0)
    # which shard is mine is resolved at run time: no function of the step asks for the rank
    externs = []
    tvm_ffi.structural_walk(func, [(relax.ExternFunc, lambda f: externs.append(f.global_symbol))])
    assert "raf_dist.ccl.local_shard" in externs or level == 3
    assert not any("rank" in name for name in externs), externs


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])  # tables updated on their rows / densely
def test_guard_reads_the_local_tables_and_keeps_their_update(optimizer):
    """nonfinite="skip" under ZeRO beside sharded embedding tables (raf_dist.local_params):
    each rank's verdict also reads its tables' gradients (one isfinite per local gradient
    beyond the loss's and the reduced buckets'), and their updates happen only when every
    rank's verdict is finite: a sparse row update's ``keep`` is the agreed verdict, a dense
    update's new table and states are ``where(all_finite, new, old)``."""
    module, x, _ = make_sharded_rec(4)
    tables = [n for n, _ in module.named_parameters() if n.startswith(("tables.", "category."))]
    mod, signature = build_train_step(raf_dist.frontend.from_pytorch(module, x), "cross_entropy",
                                      raf_optimizer(optimizer),
                                      local_grads=(tuple(tables), 2, True))
    local = [signature.param_names.index(n) for n in tables]
    bucket_bytes = 500
    n_buckets = len(gradient_buckets(mod, bucket_bytes))
    func = ShardZeRO(2, 2, bucket_bytes, guard=True)(mod)["train_step"]
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    by_name = {v.name: v for v in bindings}
    verdict = by_name["all_finite"]
    isfinite = [v for v, e in bindings.items()
                if isinstance(e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.isfinite"))]
    assert len(isfinite) == 1 + n_buckets + len(local), (len(isfinite), n_buckets)
    outputs = bindings[func.body.body].fields if isinstance(func.body.body, relax.Var) else \
        func.body.body.fields
    n_in = 4 + 1  # dense, ids, category, weights; the target
    if optimizer == "sgd":
        updates = [e for e in bindings.values() if isinstance(e, relax.Call) and e.args
                   and isinstance(e.args[0], relax.ExternFunc)
                   and e.args[0].global_symbol == "raf_dist.embedding.sgd_rows"]
        assert len(updates) == len(local)
        assert all(u.args[5].same_as(verdict) for u in updates)  # (args[0]: the function)
    else:
        for k in local:
            kept = bindings[outputs[1 + k]]
            assert kept.op.same_as(tvm.ir.Op.get("relax.where")), kept
            assert kept.args[0].same_as(verdict) and kept.args[2].same_as(func.params[n_in + k])


def _last_gradient_position(func, mod):
    """Binding position (in ``func``) of the last gradient backward produces."""
    markers = find_markers(mod["train_step"].body.blocks[0])
    last = markers[-1].grad
    bindings = [b for block in func.body.blocks for b in block.bindings]
    return next(i for i, b in enumerate(bindings) if b.var.name == last.name)


def test_level1_reduces_after_backward_level2_during():
    mod, _ = _step()
    positions = {}
    for level in (1, 2):
        func = ShardZeRO(level, 2, 1000)(mod)["train_step"]
        reduce_scatters, _ = _calls(func, "raf_dist.ccl.reduce_scatter")
        positions[level] = (reduce_scatters[0], _last_gradient_position(func, mod))
    first, last_grad = positions[1]
    assert first > last_grad  # level 1: every reduce_scatter after backward
    first, last_grad = positions[2]
    assert first < last_grad  # level 2: the first bucket is reduced while backward goes on


def _max_live_gradient_bytes(func, mod):
    """Largest number of bytes of full gradients alive at once (a variable lives from its
    binding to its last use: the wait of its bucket's reduce_scatter, which names it)."""
    markers = find_markers(mod["train_step"].body.blocks[0])
    grad_names = {m.grad.name for m in markers}
    bindings = [b for block in func.body.blocks for b in block.bindings]
    last_use = {}
    for i, b in enumerate(bindings):
        for v in relax.analysis.free_vars(b.value):
            last_use[v] = i
    for v in relax.analysis.free_vars(func.body.body):
        last_use[v] = len(bindings)
    events = []
    for i, b in enumerate(bindings):
        name = b.var.name
        if name in grad_names:
            ty = b.var.ty
            nbytes = int(np.prod([int(d) for d in ty.shape])) * 4
            events += [(i, nbytes), (last_use.get(b.var, i) + 0.5, -nbytes)]
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def test_level2_gradients_die_at_their_reduce_scatter():
    mod, signature = _step("wide_mlp", batch=4)
    bucket_bytes = 100_000
    psi_bytes = 4 * sum(int(np.prod(s)) for s, _ in signature.param_specs)
    biggest = max(sum(4 * int(np.prod(signature.param_specs[k][0])) for k in b)
                  for b in gradient_buckets(mod, bucket_bytes))
    live = {level: _max_live_gradient_bytes(ShardZeRO(level, 2, bucket_bytes)(mod)["train_step"], mod)
            for level in (1, 2)}
    assert live[1] >= psi_bytes  # level 1: every full gradient alive when backward ends
    assert live[2] <= 4 * biggest < psi_bytes  # level 2: a few buckets at a time


def test_zero1_plans_only_the_gradient_shards_beyond_plain_data_parallel():
    """Issue #27 item 5, on bench/zero.py's MLP (784-1024-1024-10, 1.86M parameters, per-rank
    batch 32 of 128), AdamW, N = 4, 1 MB buckets, planned by TVM's memory planner: ZeRO-1
    keeps every full gradient until backward ends, as plain data parallelism does, and adds
    only the reduce-scattered shards (4 Psi / N), since gradients are reduced where they live
    and the updated shards are gathered into the parameters (no packed or gathered copy of a
    bucket; it planned level 0 + 4 Psi before). ZeRO-2, whose gradients die bucket by bucket,
    plans less still."""
    torch.manual_seed(0)
    model = raf_dist.frontend.from_pytorch(MLP((784, 1024, 1024, 10)), (torch.randn(32, 784),))
    world_size = 4
    planned = {level: raf_dist.estimate_memory(model, raf_optimizer("adamw"), world_size, level,
                                               bucket_size_mb=1)["planned_peak_bytes"]
               for level in (0, 1, 2)}
    shard_bytes = 4 * model.num_params() / world_size
    # 10%: the shards' padding and the planner's rounding of the blocks they share with
    # activations (measured: level 1 = level 0 + 0.86 x 4 Psi / N)
    assert planned[1] <= planned[0] + 1.1 * shard_bytes, (planned, shard_bytes)
    assert planned[2] < planned[1], planned


def test_level3_regathers_only_what_backward_reads():
    mod, signature = _step()  # MLP: backward reads the 2nd and 3rd weights only
    func = ShardZeRO(3, 2, 10**9)(mod)["train_step"]
    names = {b.var.name for block in func.body.blocks for b in block.bindings}
    assert "backward_gather0_shards" in names  # one backward bucket...
    assert not any(n.startswith("backward_gather1") for n in names)  # ...and no second
    gathered = [b for block in func.body.blocks for b in block.bindings
                if b.var.name == "backward_gather0_shards"]
    # raf_dist.bucket.concat(shards..., out): one copy per tensor into the bucket's shard
    concat_args = {a.name for a in gathered[0].value.args[1].fields}
    assert concat_args == {"p_layers_1_weight", "p_layers_2_weight"}


def _gathered_bytes(func, region="forward"):
    """Bytes the allgathers of ``func``'s ``region`` write (their full outputs), by dtype."""
    allocs = {b.var: b.var.ty for block in func.body.blocks for b in block.bindings}
    positions, bindings = _calls(func, "raf_dist.ccl.allgather")
    totals = {}
    for i in positions:
        if not bindings[i].var.name.startswith(f"{region}_gather"):
            continue
        for out in bindings[i].value.args[2:]:  # (packed shards, group, full outputs...)
            ty = allocs[out]
            totals[str(ty.dtype)] = totals.get(str(ty.dtype), 0) + int(np.prod(
                [int(d) for d in ty.shape])) * np.dtype(str(ty.dtype).replace(
                    "bfloat16", "float16")).itemsize
    return totals


def test_level3_gathers_16_bit_copies_under_mixed_precision():
    """Mixed precision: a parameter the forward reads only as AutoCast's bf16 copy is
    gathered as that copy (its shard cast first): the forward's gathers move half the bytes
    of the float32 step's (the MLP's forward reads every parameter as its bf16 copy; one read
    in float32 too would stay float32). Backward then reads the forward's bf16 copies, not
    the parameters: nothing to gather again."""
    module, x, _ = make("mlp", 4)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    full, half = ({dtype: b for dtype, b in _gathered_bytes(ShardZeRO(3, 2, 10**9)(
        build_train_step(model, "cross_entropy", raf_optimizer("adamw"),
                         compute_dtype=compute)[0])["train_step"]).items()}
        for compute in (None, "bfloat16"))
    assert set(full) == {"float32"}, full
    assert "bfloat16" in half, half
    forward_full = sum(full.values())
    assert sum(half.values()) < forward_full
    # every byte the float32 step gathered is gathered in half the bytes or kept float32
    assert 2 * half.get("bfloat16", 0) + half.get("float32", 0) == forward_full, (full, half)
    func = ShardZeRO(3, 2, 10**9)(build_train_step(
        model, "cross_entropy", raf_optimizer("adamw"), compute_dtype="bfloat16")[0])
    names = {b.var.name for block in func["train_step"].body.blocks for b in block.bindings}
    assert any(n.startswith("forward_gather0_low") for n in names), names
    assert not _gathered_bytes(func["train_step"], "backward")


def test_level3_forward_gathers_prefetch_one_bucket_ahead():
    mod, _ = _step()
    func = ShardZeRO(3, 2, 1000, overlap=True)(mod)["train_step"]
    names = [b.var.name for block in func.body.blocks for b in block.bindings]
    order = [name for name in names
             if (name.startswith("forward_gather") and name.endswith("_handle"))
             or name.startswith("wait_forward_gather")]
    # start 0, then at each wait k the start of k+1 follows before bucket k is used
    assert order[:3] == ["forward_gather0_handle", "wait_forward_gather0", "forward_gather1_handle"]


# ---- bad input --------------------------------------------------------------------------
def test_level_outside_1_to_3_is_rejected():
    with pytest.raises(ValueError, match="level must be 1, 2 or 3"):
        ShardZeRO(0, 2, 1000)
    with pytest.raises(ValueError, match="level must be 1, 2 or 3"):
        ShardZeRO(4, 2, 1000)


def test_non_elementwise_update_is_rejected():
    @I.ir_module
    class NormClipped:  # an update reading the gradient's norm cannot run on shards
        @R.function
        def train_step(x: R.Tensor((3,), "float32"), w: R.Tensor((3,), "float32")):
            R.func_attr({"raf_dist.param_offset": 1, "raf_dist.num_params": 1,
                         "raf_dist.states_per_param": 0})
            with R.dataflow():
                loss = R.sum(R.multiply(x, w))
                m = R.call_pure_packed("raf_dist.mark_gradient", x, R.prim_value(0),
                                       ty_args=R.Tensor((3,), "float32"))
                norm = R.sum(R.multiply(m, m))
                new_w = R.subtract(w, R.multiply(m, norm))
                out = (loss, new_w)
                R.output(out)
            return out

    with pytest.raises(ValueError, match="elementwise.*norm"):
        ShardZeRO(2, 2, 1000)(NormClipped)


def test_different_update_rules_are_rejected():
    @I.ir_module
    class TwoRules:
        @R.function
        def train_step(x: R.Tensor((3,), "float32"), w1: R.Tensor((3,), "float32"),
                       w2: R.Tensor((3,), "float32")):
            R.func_attr({"raf_dist.param_offset": 1, "raf_dist.num_params": 2,
                         "raf_dist.states_per_param": 0})
            with R.dataflow():
                loss = R.sum(R.multiply(R.multiply(x, w1), w2))
                m1 = R.call_pure_packed("raf_dist.mark_gradient", x, R.prim_value(0),
                                        ty_args=R.Tensor((3,), "float32"))
                m2 = R.call_pure_packed("raf_dist.mark_gradient", x, R.prim_value(1),
                                        ty_args=R.Tensor((3,), "float32"))
                new_w1 = R.subtract(w1, R.multiply(m1, R.const(0.1, "float32")))
                new_w2 = R.subtract(w2, R.multiply(m2, R.const(0.2, "float32")))
                out = (loss, new_w1, new_w2)
                R.output(out)
            return out

    with pytest.raises(ValueError, match="w2's update differs from w1's"):
        ShardZeRO(1, 2, 1000)(TwoRules)


def test_step_without_layout_attributes_is_rejected():
    with pytest.raises(ValueError, match="layout attributes"):
        ShardZeRO(1, 2, 1000)(tvm.IRModule(
            {"train_step": Before["train_step"].without_attr("raf_dist.param_offset")}))


def test_native_concat_copies_shards_at_any_offset_and_checks_sizes():
    """raf_dist.bucket.concat, ZeRO-3's shards into a bucket's flat shard (src/ccl/bucket.cc):
    element offsets that are no multiple of 64 bytes (1, 5, 7 floats), sizes checked."""
    raf_dist._native.load()
    concat = tvm_ffi.get_global_func("raf_dist.bucket.concat")
    parts = [np.arange(n, dtype=np.float32) + 100 * i for i, n in enumerate((1, 5, 7))]
    out = tvm.runtime.tensor(np.full(13, -1.0, np.float32))
    concat(*[tvm.runtime.tensor(p) for p in parts], out)
    np.testing.assert_array_equal(out.numpy(), np.concatenate(parts))
    with pytest.raises(ValueError, match="hold 6 elements, the output 13"):
        concat(*[tvm.runtime.tensor(p) for p in parts[:2]], out)
    with pytest.raises(ValueError, match="more than the 13 elements"):
        concat(*[tvm.runtime.tensor(p) for p in parts + parts], out)
    with pytest.raises(TypeError, match="differs in dtype"):
        concat(tvm.runtime.tensor(np.zeros(13, np.float64)), out)
