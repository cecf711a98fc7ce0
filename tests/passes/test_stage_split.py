"""Pipeline stages in one process (passes/stage_partition.py, passes/stage_split.py): the stage
marker through TVM's Gradient, the cut points and the partitioner (every binding in exactly
one stage, uneven layer counts, split points by module name, markers), and the stage
functions run in sequence (every stage on this one rank, local hand-over) equal to the
unsplit step: bitwise at M = 1, to float rounding with microbatches, with recomputed
activations, with a parameter tied across stages."""
import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import raf_dist
from raf_dist.frontend import from_pytorch
from raf_dist.ir.ops import STAGE_MARKER_GRAD, stage_boundary
from raf_dist.passes.stage_partition import ForwardGraph, partition
from raf_dist.passes.stage_split import split_forward, strip_stage_markers
from raf_dist.distributed import get_communicator, get_config
from raf_dist.runtime import stage_budget
from raf_dist.runtime.pipeline_executor import PipelineExecutor
from raf_dist.distributed.mesh import mesh_for
from raf_dist.runtime.plan import plan_run

from models import make, rel_err


def _graph(model):
    return ForwardGraph(model.forward, len(model.input_specs), len(model.dropout_specs),
                        model.param_names)


def _two_layer_with_marker():
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w1 = relax.Var("w1", relax.TensorType((8, 8), "float32"))
    w2 = relax.Var("w2", relax.TensorType((8, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("forward", [x, w1, w2]):
        with bb.dataflow():
            h = bb.emit(relax.op.tanh(relax.op.matmul(x, w1)))
            h = bb.emit(stage_boundary(h))
            h2 = bb.emit(relax.op.tanh(h))
            out = bb.emit_output(bb.emit(relax.op.matmul(h2, w2)))
        bb.emit_func_output(out)
    return bb.get()["forward"]


def test_marker_survives_gradient_as_its_mirror():
    func = _two_layer_with_marker()
    mod = tvm.IRModule({tvm.ir.GlobalVar("main"): func.with_attr("global_symbol", "main")})
    loss_x = relax.Var("p", func.ret_ty)
    lb = relax.BlockBuilder()
    with lb.function("loss", [loss_x]):
        with lb.dataflow():
            v = lb.emit_output(lb.emit(relax.op.sum(loss_x)))
        lb.emit_func_output(v)
    mod = relax.training.AppendLoss("main", lb.get()["loss"], num_backbone_outputs=1)(mod)
    mod = relax.transform.Gradient("main_loss", require_grads=list(
        mod["main_loss"].params[1:3]))(mod)
    text = mod["main_loss_adjoint"].script()
    assert STAGE_MARKER_GRAD in text  # the backward crosses the same cut
    assert "raf_dist.pipeline_stage" not in strip_stage_markers(func).script()


def test_markers_choose_the_stages():
    func = _two_layer_with_marker()
    graph = ForwardGraph(func, 1, 0, ["w1", "w2"])
    plan = partition(graph, 2)
    assert plan.how == "markers" and plan.params == [["w1"], ["w2"]]
    with pytest.raises(ValueError, match="2 stages"):
        partition(graph, 3)


@pytest.mark.parametrize("name,stages", [("mlp8", 3), ("transformer", 4), ("tied", 2),
                                         ("cnn", 3)])
def test_every_binding_lands_in_exactly_one_stage(name, stages):
    module, x, _ = make(name, 4)
    model = from_pytorch(module, (x,))
    graph = _graph(model)
    plan = partition(graph, stages)
    assert plan.how == "partitioner"
    bounds = [plan.bounds(s) for s in range(stages)]
    assert bounds[0][0] == 0 and bounds[-1][1] == len(graph.data)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:]))
    # uneven layer counts drop nothing: every parameter is on some stage
    assert set().union(*map(set, plan.params)) == set(model.param_names)
    funcs = split_forward(plan)
    data_ops = sum(1 for f in funcs for b in f.function.body.blocks[0].bindings
                   if not isinstance(b.value, relax.Var))
    assert data_ops >= len(graph.data)  # parameter-only bindings are cloned, none dropped
    for f, nxt in zip(funcs, funcs[1:]):
        # one activation crosses each cut
        assert str(f.function.ret_ty) == str(nxt.function.params[0].ty)


def test_batch_norm_buffers_stay_on_the_stage_that_normalises():
    """Each running statistic is read and written by one stage (its BatchNorm's), which
    returns the new values after its activation; no buffer value crosses a cut."""
    from raf_dist.passes.batch_norm import decompose_forward

    module, x, _ = make("res_bn", 4)
    model = decompose_forward(from_pytorch(module, (x,)))
    graph = ForwardGraph(model.forward, 1, 0, model.param_names, model.buffer_names)
    plan = partition(graph, 2)
    funcs = split_forward(plan)
    written = [b for f in funcs for b in f.buffers_written]
    assert sorted(written) == sorted(model.buffer_names)  # each exactly once
    for s, f in enumerate(funcs):
        assert list(f.buffer_names) == [b for b in model.buffer_names if b in f.buffers_written]
        modules = {b.rpartition(".")[0] for b in f.buffers_written}
        assert all(any(n.startswith(m + ".") for n in plan.params[s]) for m in modules
                   if any(n.startswith(m + ".") for n in model.param_names)), (s, modules)
        ret = f.function.ret_ty
        if f.buffers_written:
            assert len(ret.fields) == 1 + len(f.buffers_written)
            ret = ret.fields[0]
        if s + 1 < len(funcs):
            assert str(ret) == str(funcs[s + 1].function.params[0].ty)


def test_split_points_by_module_name():
    module, x, _ = make("mlp8", 4)
    graph = _graph(from_pytorch(module, (x,)))
    plan = partition(graph, 3, ["layers.3", "layers.6"])
    assert plan.how == "split points"
    assert plan.params[1][0] == "layers.3.weight" and plan.params[2][0] == "layers.6.weight"
    with pytest.raises(ValueError, match="no parameter is named 'blocks.1'"):
        partition(graph, 3, ["layers.3", "blocks.1"])
    with pytest.raises(ValueError, match="names 1 split points"):
        partition(graph, 3, ["layers.3"])
    tgraph = _graph(from_pytorch(*make("transformer", 4)[:1], (make("transformer", 4)[1],)))
    with pytest.raises(ValueError, match="no single tensor crosses the boundary before 'proj'"):
        partition(tgraph, 3, ["qkv", "proj"])  # the residual stream and the attention


def _pipeline_executor(model, optimizer):
    """The pipeline executor at pp = 1 (every stage on this rank: interleaved stages), which
    the Trainer never picks itself (it runs pp = 1 on the SPMD executor)."""
    config, comm = get_config(), get_communicator()
    plan = plan_run(config, comm.size)
    return PipelineExecutor(model, "cross_entropy", optimizer, "cpu", plan,
                            mesh_for(plan.layout), comm)


def _run(config, name, stages, microbatches, steps=3, checkpointing=False, budget=None):
    module, x, y = make(name, 8)
    model = from_pytorch(module, (x,))
    reference = raf_dist.Trainer(model, optimizer=raf_dist.optim.Adam(lr=1e-2))
    config.update({"pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": stages,
                   "num_microbatches": microbatches, "activation_checkpointing": checkpointing,
                   "activation_memory_budget_mb": budget})
    trainer = _pipeline_executor(model, raf_dist.optim.Adam(lr=1e-2))
    pairs = [(reference.step(x.numpy(), y.numpy()), trainer.step(x.numpy(), y.numpy()))
             for _ in range(steps)]
    return pairs, reference.state_dict(), trainer.state_dict(), trainer


def test_stages_in_sequence_equal_the_unsplit_step_bitwise(dist_config):
    pairs, want, got, trainer = _run(dist_config, "transformer", 3, 1)
    assert all(a == b for a, b in pairs), pairs
    assert all(np.array_equal(want[k], got[k]) for k in want)
    assert trainer.stats()["pipeline"]["peak_saved_microbatches"] == {0: 1, 1: 1, 2: 1}


@pytest.mark.parametrize("name,stages,microbatches,checkpointing", [
    ("transformer", 2, 4, False),   # microbatch losses weighted by rows, gradients accumulated
    ("tied", 2, 2, True),           # tok.weight on both stages; activations recomputed
])
def test_stages_with_microbatches_equal_one_step(dist_config, name, stages, microbatches,
                                                 checkpointing):
    pairs, want, got, _ = _run(dist_config, name, stages, microbatches,
                                checkpointing=checkpointing)
    assert rel_err([b for _, b in pairs], [a for a, _ in pairs]) <= 1e-6, pairs
    for key in want:
        assert rel_err(got[key], want[key]) <= 1e-5, key


def test_selective_stages_save_less_and_train_the_same(dist_config):
    """activation_checkpointing="selective" under pipelining: each stage's forward saves its
    matmul outputs and what recomputation starts from, its backward recomputes the rest
    (passes/remat.py's "selective" on the stage's adjoint); the step is the same."""
    saved = {}
    for policy in (False, "selective"):
        dist_config.reset()
        pairs, want, got, trainer = _run(dist_config, "transformer", 2, 2,
                                         checkpointing=policy)
        assert rel_err([b for _, b in pairs], [a for a, _ in pairs]) <= 1e-6, (policy, pairs)
        for key in want:
            assert rel_err(got[key], want[key]) <= 1e-5, (policy, key)
        saved[policy] = trainer.stats()["pipeline"]["peak_saved_bytes"]
        if policy:
            backward = [st.functions.mod["backward"].script()
                        for st in trainer._stage_sets[4].stages.values()]
            assert any("_re: " in text for text in backward)
    assert sum(saved["selective"].values()) < 0.8 * sum(saved[False].values()), saved


def _modelled_peak(trainer):
    """(runtime/stage_budget.py's model of the trainer's activation memory; per stage the
    bytes the schedule should hold at its peak: the most microbatches in flight x saved)."""
    timeline = stage_budget.held_timeline(trainer.actions[trainer.pp_rank], trainer.my_stages)
    stages = trainer._stage_sets[trainer.builder.plan_rows].stages
    per_stage = {s: max(live[s] for live, _ in timeline)
                 * stage_budget.saved_bytes(st.functions, trainer.stage_recompute[s])
                 for s, st in stages.items()}
    return trainer.stats()["pipeline"]["modelled_activation_bytes"], per_stage


def test_budget_chooses_recomputation_per_stage_and_trains_the_same(dist_config):
    """activation_memory_budget_mb under pipelining: a budget between the modelled activation
    memory without recomputation and with "full" on every stage gets some recomputation, fits,
    and the step is the same; the model's saved bytes are what the schedule really held (the
    runtime's counters); a budget under "full"'s is refused naming the smallest."""
    peaks = {}
    for policy in (False, "full"):
        dist_config.reset()
        pairs, want, got, trainer = _run(dist_config, "transformer", 2, 4, steps=1,
                                         checkpointing=policy)
        peaks[policy], per_stage = _modelled_peak(trainer)
        pipeline = trainer.stats()["pipeline"]
        assert per_stage == pipeline["peak_saved_bytes"], policy
        # the saved values and the handoffs between the stages the rank held at once, as the
        # model walks its actions (real messages: tests/distributed/workers/pp_train.py)
        assert pipeline["peak_held_bytes"] == pipeline["modelled_held_bytes"], policy
        assert pipeline["modelled_held_bytes"] > max(per_stage.values()), policy
    assert peaks["full"] < peaks[False], peaks
    dist_config.reset()
    pairs, want, got, trainer = _run(dist_config, "transformer", 2, 4,
                                     budget=(peaks[False] + peaks["full"]) / 2 / 2**20)
    chosen = trainer.stats()["pipeline"]["recompute"]
    assert any(chosen.values()) and chosen != {0: "full", 1: "full"}, chosen
    peak, per_stage = _modelled_peak(trainer)
    assert peak <= dist_config.activation_memory_budget_mb * 2**20, (peak, chosen)
    pipeline = trainer.stats()["pipeline"]
    assert per_stage == pipeline["peak_saved_bytes"]
    assert pipeline["peak_held_bytes"] == pipeline["modelled_held_bytes"]
    assert rel_err([b for _, b in pairs], [a for a, _ in pairs]) <= 1e-6, pairs
    for key in want:
        assert rel_err(got[key], want[key]) <= 1e-5, key
    dist_config.activation_memory_budget_mb = (peaks["full"] - 1) / 2**20
    module, x, _ = make("transformer", 8)
    with pytest.raises(ValueError, match="cannot fit; the smallest modelled") as refused:
        _pipeline_executor(from_pytorch(module, (x,)), raf_dist.optim.Adam(lr=1e-2))
    smallest = float(str(refused.value).split("activation memory is ")[1].split(" MB")[0])
    assert smallest <= peaks["full"] / 2**20 * 1.001, (str(refused.value), peaks)  # 3 digits


@pytest.mark.parametrize("fields,error,match", [
    ({"zero_opt_level": 2, "enable_data_parallel": True}, ValueError, "zero_opt_level=2"),
    ({"pipeline_schedule": "zero_bubble"}, NotImplementedError, "zero_bubble"),
    ({"pipeline_schedule": "interleaved_1f1b", "num_microbatches": 3}, ValueError,
     "multiple of pipeline_parallel_size=2"),
    ({"num_microbatches": 3}, ValueError, "does not divide into equal microbatches"),
])
def test_unsupported_pipelines_are_refused_before_any_collective(dist_config, fields, error,
                                                                 match):
    module, x, _ = make("mlp", 8)
    model = from_pytorch(module, (x,))
    dist_config.update(dict({"pipeline_parallel_size": 2}, **fields))
    with pytest.raises(error, match=match):
        raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1))


class _MarkedNet(torch.nn.Module):
    """A PyTorch model that names its own stage boundary (raf_dist.frontend.pipeline_split)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(6, 8), torch.nn.Linear(8, 8),
                                  torch.nn.Linear(8, 3))

    def forward(self, x):
        x = raf_dist.frontend.pipeline_split(torch.tanh(self.a(x)))
        return self.c(torch.tanh(self.b(x)))


def test_a_pytorch_marker_cuts_there_and_trains_like_the_unmarked_model(dist_config):
    torch.manual_seed(0)
    net, x = _MarkedNet(), torch.randn(4, 6)
    y = torch.randint(0, 3, (4,))
    out = net(x)
    out.sum().backward()  # the marker is the identity for PyTorch, forward and backward
    model = from_pytorch(net, (x,))
    plan = partition(_graph(model), 2)
    assert plan.how == "markers" and plan.params[0] == ["a.weight", "a.bias"]
    plain = raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1))  # marker stripped
    dist_config.update({"pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": 2})
    staged = _pipeline_executor(model, raf_dist.optim.SGD(lr=0.1))
    for _ in range(2):
        assert plain.step(x.numpy(), y.numpy()) == staged.step(x.numpy(), y.numpy())


def test_update_step_reduces_gradients_in_bfloat16():
    """Trainer(grad_reduce_dtype="bfloat16") under pipelining: the update casts each float32
    accumulator to bf16 before its gradient marker and back after it, so the dp allreduce
    (AllReduceGradients, as for the SPMD step) moves half the bytes, and the optimizer still
    reads a float32 gradient."""
    from raf_dist.passes import AllReduceGradients
    from raf_dist.passes.gradient_markers import find_markers
    from raf_dist.training.pipeline_step import build_update_step

    names, specs = ["w", "b"], [((64, 32), "float32"), ((32,), "float32")]
    optimizer = raf_dist.optim.AdamW(lr=1e-3)
    full, half = (build_update_step(names, specs, optimizer, reduce_dtype=d)
                  for d in (None, "bfloat16"))
    assert "bfloat16" not in full.script()
    script = half.script()
    assert script.count('R.astype(w__grad_acc, dtype="bfloat16")') == 1, script
    assert script.count('R.astype(b__grad_acc, dtype="bfloat16")') == 1, script

    def bucket_bytes(mod):  # what the markers hand to the dp reduction
        return sum(m.nbytes for m in find_markers(mod["train_step"].body.blocks[0]))

    assert bucket_bytes(half) * 2 == bucket_bytes(full)
    reduced = AllReduceGradients(2, 10**6)(half)["train_step"].script()
    assert 'dtype="bfloat16"' in reduced and "raf_dist.ccl.allreduce" in reduced


def test_bf16_stages_save_the_forwards_16_bit_copies():
    """A bf16 stage (AutoCast) saves the 16-bit copies of the values AutoCast widened for its
    layer norms and narrowed from its softmax, as the one-function step does
    (passes/saved_precision.py): fewer saved bytes, no float32 value saved that has a 16-bit
    twin, the same stage otherwise (its inputs, parameters and outputs)."""
    from raf_dist.passes.auto_cast import auto_cast
    from raf_dist.training.pipeline_step import build_stage_functions

    module, x, _ = make("transformer", 8)
    model = from_pytorch(module, (x,))
    funcs = split_forward(partition(_graph(model), 2))
    for s, f in enumerate(funcs):
        last = s == len(funcs) - 1
        forward = auto_cast(f.function, "bfloat16", low_output=not last)
        built = {low: build_stage_functions(
            s, last, forward, f.mask_indices, f.param_names, (), "cross_entropy",
            target_spec=((tuple(int(d) for d in list(f.output_type.shape)[:-1]), "int64")
                         if last else None), low_precision=low)
            for low in (False, True)}
        saved = {}
        for low, fns in built.items():
            fields = []  # the saved values, an attention op's (output, log-sum-exp) flattened
            for t in fns.mod["forward"].ret_ty.fields[1:1 + fns.num_saved]:
                fields += list(t.fields) if hasattr(t, "fields") else [t]
            saved[low] = {dt: sum(int(np.prod([int(d) for d in t.shape]))
                                  for t in fields if str(t.dtype) == dt)
                          for dt in {str(t.dtype) for t in fields}}
        nbytes = {low: sum(n * (2 if dt == "bfloat16" else 4) for dt, n in by.items())
                  for low, by in saved.items()}
        assert nbytes[True] < nbytes[False], (s, saved)
        assert saved[True].get("float32", 0) < saved[False].get("float32", 0), (s, saved)
        assert ([str(p.ty) for p in built[True].mod["forward"].params]
                == [str(p.ty) for p in built[False].mod["forward"].params])
