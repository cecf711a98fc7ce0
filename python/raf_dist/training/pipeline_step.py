"""Each pipeline stage's training functions (DESIGN.md section 3c).

For stage s (its forward cut out by passes/stage_split.py) the stage's objective is appended
and TVM's Gradient differentiates it:

- a stage before the last: ``sum(output * dy)``, whose gradients are the vector-Jacobian
  product with the gradient ``dy`` the next stage sends back (and the gradient of the stage
  input, sent to the previous stage);
- the last stage: ``loss(output, target) * seed``, ``seed`` being this microbatch's share of
  the global batch (rows, not a mean of means), so its gradients arrive weighted.

The differentiated function is then split in two by what the microbatch's *forward* result
needs (its output, or the unweighted loss on the last stage): those bindings are
``forward``; every other binding is ``backward``, and what backward reads of forward's
values are forward's extra outputs (the activations saved for backward, held by the
executor until that microbatch's backward). The module holds:

    forward(*inputs, *masks, [target], *params) -> (output or loss, *saved)
    backward(*saved, seed or dy, *params, *grad_accs) -> (dx, *grad_accs + gradients)
    recompute(*inputs, *masks, [target], seed or dy, *params, *grad_accs) -> as backward
        (activation checkpointing: forward again inside backward, nothing saved)
    forward_only(*inputs, *masks, [target], *params) -> output or loss

``dx`` is the stage input's gradient (a 0-d zero on the first stage, whose inputs are data).
Backward adds into the accumulators in place (``raf_dist.updated_arguments``). The update is
its own function (``build_update_step``): the optimizer over the accumulated gradients, with
gradient markers, so the data-parallel and ZeRO-1 passes apply to it unchanged over the dp
group, once per step after the last microbatch.
"""
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Set, Tuple

import tvm
from tvm import relax

from ..ir.attrs import (LAYOUT_NUM_PARAMS, LAYOUT_PARAM_OFFSET, LAYOUT_STATES_PER_PARAM,
                        UPDATE_GROUPS, UPDATED_ARGUMENTS)
from ..passes.stage_split import emit_function, stage_input_count
from ..passes.remat import rematerialize
from ..passes.saved_precision import save_low_precision
from ..passes.sequence_parallel import regather_in_backward
from . import gradients, gradients_spatial  # noqa: F401  (register the gradients TVM lacks)
from .cross_entropy import narrow_loss_input
from .loss import build_loss
from ..model import Model, TensorSpec
from ..optim.optimizer import Optimizer
from ..passes.clipping import Clip
from .adjoint import follow_aliases, forward_length, loss_and_grads, missing_gradients
from .optimizer_update import (emit_update, identifier, in_param_dtypes, mark_in,
                               optimizer_groups, state_type)
from .step import GRAD_UNSCALE

if TYPE_CHECKING:
    from ..passes.stage_partition import StagePlan


@dataclasses.dataclass
class StageFunctions:
    """One stage's module and calling convention."""

    index: int
    last: bool
    mod: tvm.IRModule
    input_specs: List[TensorSpec]  # the data inputs (stage 0) or the activation in
    mask_indices: List[int]  # which of the model's dropout masks the stage reads
    param_names: List[str]  # every parameter the stage reads, model order
    trainable: List[str]  # those with a gradient (not frozen), model order
    output_spec: TensorSpec  # (shape, dtype) of forward's first output (the loss on the last)
    num_saved: int  # forward's saved values
    input_grad: bool  # backward's dx is the stage input's gradient (else a 0-d placeholder)
    seed_spec: TensorSpec  # (shape, dtype) of backward's seed (the dy, or the 0-d weight)
    target_spec: Optional[TensorSpec] = None  # the last stage's target
    buffer_names: List[str] = dataclasses.field(default_factory=list)  # read, after the params
    buffers_written: List[str] = dataclasses.field(default_factory=list)  # returned by forward


def _objective(last: bool, loss: str, pred_ty: relax.TensorType,
               target_spec: Optional[Sequence[Any]], vocab_parallel: bool
               ) -> Tuple[relax.Function, Optional[Sequence[Any]]]:
    """(objective Relax function, target spec) for a stage (module docstring)."""
    shape = [int(d) for d in pred_ty.shape]
    if last:
        target_shape, target_dtype = (None, None) if target_spec is None else target_spec
        return build_loss(loss, shape, pred_ty.dtype, target_shape, target_dtype,
                          weighted=True, vocab_parallel=vocab_parallel)
    pred = relax.Var("prediction", pred_ty)
    dy = relax.Var("output_grad", pred_ty)
    bb = relax.BlockBuilder()
    with bb.function("loss", [pred, dy]):
        with bb.dataflow():
            product = bb.emit(relax.op.multiply(pred, dy))
            if str(pred_ty.dtype) != "float32":  # a 16-bit boundary (mixed precision): TVM's
                # Gradient takes only a float32 / float64 target (bfloat16 is not "float" to it)
                product = bb.emit(relax.op.astype(product, "float32"))
            out = bb.emit_output(bb.emit(relax.op.sum(product)))
        bb.emit_func_output(out)
    return bb.get()["loss"], None


def build_stage_functions(index: int, last: bool, forward: relax.Function,
                          mask_indices: Sequence[int], param_names: Sequence[str],
                          frozen: Set[str], loss: str,
                          target_spec: Optional[Sequence[Any]] = None,
                          vocab_parallel: bool = False, buffer_names: Sequence[str] = (),
                          buffers_written: Sequence[str] = (), selective: bool = False,
                          low_precision: bool = False) -> StageFunctions:
    """The StageFunctions of stage ``index`` (module docstring). ``forward`` is the stage's
    function from passes.stage_split.split_forward: ``(*inputs, *masks, *params, *buffers) ->
    output``, or ``(output, *new values of buffers_written)`` (batch norm already
    decomposed: passes/batch_norm.py). Such a stage's ``forward`` and ``forward_only`` return
    the new buffer values last (once per microbatch, in order); ``recompute`` reads the
    buffers and leaves them alone. ``selective`` (activation_checkpointing="selective"):
    ``forward`` saves only what passes/remat.py's "selective" keeps (matmul and convolution
    outputs, and what the recomputation starts from) and ``backward`` recomputes the cheap
    rest before its first use (the same pass as the one-function step's). ``low_precision``
    (a stage AutoCast cast to bf16 / fp16): the backward reads the forward's 16-bit copies of
    the values AutoCast widened or narrowed (passes/saved_precision.py, as the one-function
    step's), so the stage saves those in 16 bits."""
    n_buf = len(buffer_names)
    n_in = stage_input_count(forward, len(mask_indices), len(param_names), n_buf)
    missing = missing_gradients(forward)
    if missing:
        ops = ", ".join(f"{op} (computing {var})" for op, var in missing)
        raise NotImplementedError(f"pipeline stage {index}: no gradient is registered for "
                                  f"{ops}; register one or avoid the op")
    out_ty = forward.ret_ty.fields[0] if buffers_written else forward.ret_ty
    if not isinstance(out_ty, relax.TensorType) or out_ty.shape is None:
        raise ValueError(f"pipeline stage {index} must return one tensor of known shape, got "
                         f"{out_ty}")
    objective, target_spec = _objective(last, loss, out_ty, target_spec, vocab_parallel)
    mod = tvm.IRModule({tvm.ir.GlobalVar("main"): forward.with_attr("global_symbol", "main")})
    mod = relax.training.AppendLoss("main", objective, num_backbone_outputs=1)(mod)
    mod["main_loss"] = narrow_loss_input(mod["main_loss"])
    main = mod["main_loss"]
    n_fwd = len(forward.params)
    stage_params = list(main.params[n_in + len(mask_indices):n_fwd - n_buf])
    trainable = [n for n in param_names if n not in frozen]
    require = [v for v, n in zip(stage_params, param_names) if n not in frozen]
    input_grad = index > 0 and n_in == 1 and "float" in str(main.params[0].ty.dtype)
    if input_grad:
        require = [main.params[0]] + require
    if not require:
        raise ValueError(f"pipeline stage {index} has nothing to differentiate (no trainable "
                         "parameter and no activation input)")
    mod = relax.transform.Gradient("main_loss", require_grads=require)(mod)
    adjoint = mod["main_loss_adjoint"]
    n_forward = forward_length(adjoint)  # (both passes below rewrite the backward only)
    if low_precision:  # (AutoCast's stage) the backward reads the forward's 16-bit copies
        adjoint = save_low_precision(adjoint, n_forward)
    if selective:  # the backward reads recomputed copies of what "selective" does not keep
        adjoint = rematerialize(adjoint, n_forward, n_in, "selective", None)
    adjoint = regather_in_backward(adjoint, n_forward)  # (sequence parallelism)
    args = list(adjoint.params)
    inputs, masks = args[:n_in], args[n_in:n_in + len(mask_indices)]
    params = args[n_in + len(mask_indices):n_fwd - n_buf]
    buffers = args[n_fwd - n_buf:n_fwd]
    extra = args[n_fwd:]  # the objective's own arguments: [target,] seed
    seed, target = extra[-1], (extra[0] if last else None)
    _, grads, new_buffers = loss_and_grads(adjoint)
    bindings = [b for block in adjoint.body.blocks for b in block.bindings]
    value = {b.var: b.value for b in bindings}
    grads = [follow_aliases(g, value) for g in grads]
    dx = grads.pop(0) if input_grad else None

    # the forward result: the value the objective multiplies by the seed
    primary = None
    for b in bindings:
        v = b.value
        if (isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)
                and v.op.name == "relax.multiply" and any(a.same_as(seed) for a in v.args)):
            primary = [a for a in v.args if not a.same_as(seed)][0]
            break
    if primary is None:
        raise RuntimeError(f"pipeline stage {index}: the objective's product with the seed "
                           "was not found after Gradient")
    defined = {b.var: i for i, b in enumerate(bindings)}
    in_forward = set()
    stack = [primary, *new_buffers]
    while stack:
        var = stack.pop()
        i = defined.get(var)
        if i is None or i in in_forward:
            continue
        in_forward.add(i)
        stack.extend(relax.analysis.free_vars(bindings[i].value))
    fwd_bindings = [b for i, b in enumerate(bindings) if i in in_forward]
    bwd_bindings = [b for i, b in enumerate(bindings) if i not in in_forward]
    fwd_vars = {b.var for b in fwd_bindings}
    data_args = (set(inputs) | set(masks) | set(buffers)
                 | ({target} if target is not None else set()))
    saved = []
    for b in bwd_bindings:
        for var in relax.analysis.free_vars(b.value):
            if (var in fwd_vars or var in data_args) and var not in saved:
                saved.append(var)
    for g in grads + ([dx] if dx is not None else []):
        if (g in fwd_vars or g in data_args) and g not in saved:
            saved.append(g)

    data = inputs + masks + ([target] if target is not None else [])
    accs = [relax.Var(f"{identifier(n)}__grad_acc", v.ty)
            for n, v in zip(param_names, params) if n not in frozen]
    out_mod = tvm.IRModule()

    def function(name: str, arguments: List[relax.Var], body: List[relax.Binding],
                 outputs: Callable[[relax.BlockBuilder, Callable[[relax.Expr], relax.Expr]],
                                   relax.Expr],
                 accumulates: bool = False) -> None:
        """One function of the stage's module (DCE'd); ``accumulates``: its outputs after the
        first are the new values of its last arguments, the gradient accumulators."""
        func = emit_function(name, arguments, body, outputs)
        if accumulates:
            func = func.with_attr(UPDATED_ARGUMENTS,
                                  list(range(len(arguments) - len(accs), len(arguments))))
        out_mod[name] = relax.transform.DeadCodeElimination([name])(
            tvm.IRModule({tvm.ir.GlobalVar(name): func}))[name]

    def backward_outputs(bb: relax.BlockBuilder,
                         sub: Callable[[relax.Expr], relax.Expr]) -> relax.Expr:
        first = sub(dx) if dx is not None else relax.const(0.0, str(out_ty.dtype))
        sums = [bb.emit(relax.op.add(sub(a), sub(g))) for a, g in zip(accs, grads)]
        return relax.Tuple([first, *sums])

    function("forward", data + params + buffers, fwd_bindings,
             lambda bb, sub: relax.Tuple([sub(primary), *[sub(v) for v in saved],
                                          *[sub(v) for v in new_buffers]]))
    function("backward", saved + [seed] + params + accs, bwd_bindings, backward_outputs,
             accumulates=True)
    function("recompute", data + [seed] + params + buffers + accs, bindings, backward_outputs,
             accumulates=True)
    function("forward_only", data + params + buffers, fwd_bindings,
             lambda bb, sub: (relax.Tuple([sub(primary), *[sub(v) for v in new_buffers]])
                              if new_buffers else sub(primary)))
    return StageFunctions(
        index=index, last=last, mod=out_mod,
        input_specs=[type_spec(v.ty) for v in inputs], mask_indices=list(mask_indices),
        param_names=list(param_names), trainable=trainable, output_spec=type_spec(primary.ty),
        num_saved=len(saved), input_grad=input_grad, seed_spec=type_spec(seed.ty),
        target_spec=tuple(target_spec) if target_spec is not None else None,
        buffer_names=list(buffer_names), buffers_written=list(buffers_written))


def type_spec(ty: relax.TensorType) -> TensorSpec:
    """(shape, dtype) of a statically shaped tensor type."""
    return tuple(int(d) for d in ty.shape), str(ty.dtype)


def build_update_step(param_names: Sequence[str], param_specs: Sequence[TensorSpec],
                      optimizer: Optimizer, loss_dtype: str = "float32",
                      clip: Optional[Clip] = None, reduce_dtype: Optional[str] = None,
                      loss_scale: bool = False) -> tvm.IRModule:
    """``train_step(*params, *states, *hypers, *grad_accs, loss_sum) -> (loss_sum, *params,
    *states)``: the optimizer over the accumulated gradients, each through a gradient marker
    (so AllReduceGradients / ShardZeRO reduce them over the dp group), with the layout and
    in-place attributes of build_train_step. ``clip`` (a passes.clipping.Clip, or None under
    ZeRO, whose pass clips): the reduced gradients clipped by the global norm, the loss output
    [loss_sum, norm]. ``reduce_dtype`` (Trainer(grad_reduce_dtype="bfloat16")): each
    accumulated (float32) gradient is cast to it before its marker and back after, so the dp
    reduction moves half the bytes, as build_train_step does. ``loss_scale`` (fp16's dynamic
    loss scaling): one more hyper, ``grad_unscale`` (1 / scale), multiplies every
    accumulated gradient before its marker, as build_train_step's does."""
    params = [relax.Var(identifier(n), relax.TensorType(s, d))
              for n, (s, d) in zip(param_names, param_specs)]
    states = [relax.Var(f"{identifier(n)}__{st}", state_type(p.ty, st, optimizer.row_states))
              for n, p in zip(param_names, params) for st in optimizer.state_names]
    dtype = param_specs[0][1] if param_specs else loss_dtype
    updaters, hyper_names, groups = optimizer_groups(optimizer, param_names)
    hyper_names = list(hyper_names) + ([GRAD_UNSCALE] if loss_scale else [])
    hypers = {h: relax.Var(h, relax.TensorType((), dtype)) for h in hyper_names}
    accs = [relax.Var(f"{identifier(n)}__grad_acc", p.ty) for n, p in zip(param_names, params)]
    loss_sum = relax.Var("loss_sum", relax.TensorType((), loss_dtype))
    arguments = params + states + list(hypers.values()) + accs + [loss_sum]
    bb = relax.BlockBuilder()
    with bb.function("train_step", arguments):
        with bb.dataflow():
            if loss_scale:  # the seeds were scaled: so is every gradient
                accs = [bb.emit(relax.op.multiply(a, hypers[GRAD_UNSCALE])) for a in accs]
            grads = in_param_dtypes(bb, [mark_in(bb, a, i, reduce_dtype)
                                         for i, a in enumerate(accs)], params)
            # the loss passes through an identity so the DP pass can average a computed value
            loss_value = bb.emit(relax.op.add(loss_sum, relax.const(0.0, loss_dtype)))
            out = emit_update(bb, updaters, grads, loss_value, params, states, hypers, [],
                               None, False, clip)
        bb.emit_func_output(out)
    n, k = len(params), len(optimizer.state_names)
    attrs = {LAYOUT_PARAM_OFFSET: 0, LAYOUT_NUM_PARAMS: n, LAYOUT_STATES_PER_PARAM: k,
             UPDATED_ARGUMENTS: list(range(n * (1 + k)))}
    if len(set(groups)) > 1:
        attrs[UPDATE_GROUPS] = groups
    func = bb.get()["train_step"].with_attrs(attrs)
    return tvm.IRModule({tvm.ir.GlobalVar("train_step"): func})


def stage_plan(model: Model, num_stages: int, microbatches: int,
               split_points: Optional[Sequence[str]] = None,
               ranks: Optional[int] = None) -> "StagePlan":
    """The StagePlan (passes/stage_partition.py) of ``model`` in ``num_stages`` stages at the
    microbatch's rows, as PipelineExecutor._forward_graph reads it (tools/explain_pipeline.py's
    explanation and proxies/extract.py use it; one process, no MPI)."""
    from ..passes.batch_norm import decompose_forward, has_training_batch_norm
    from ..passes.stage_partition import ForwardGraph, partition

    rows = model.batch_size
    if rows is None:  # no inputs, or a 0-d first input: no batch to split
        raise ValueError(f"the model ({model.source}) has no batch dimension (its first input is "
                         f"{model.input_specs[0] if model.input_specs else 'missing'}): "
                         "pipelining splits dim 0 of the inputs into microbatches")
    if rows % microbatches:
        raise ValueError(f"the model was captured with {rows} rows, which {microbatches} "
                         "microbatches do not divide; capture it with a multiple of "
                         "--microbatches rows")
    at = model.at_batch(rows // microbatches) if microbatches > 1 else model
    if has_training_batch_norm(at.mod):  # as the PipelineExecutor reads it
        at = decompose_forward(at)
    graph = ForwardGraph(at.forward, len(at.input_specs), len(at.dropout_specs), at.param_names,
                         list(getattr(at, "buffer_names", ())))
    return partition(graph, num_stages, list(split_points) if split_points else None, ranks)
