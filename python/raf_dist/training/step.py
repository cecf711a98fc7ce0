"""Build the training step as one Relax function:

    train_step(*inputs, *dropout_masks, *frozen_params, target, [loss_weight], *params,
               *opt_states, *hypers, *buffers)
        -> (loss, *new_params, *new_opt_states, *new_buffers)

= forward + loss (AppendLoss) + TVM's Gradient pass + the optimizer's update, all in one
dataflow block, so later passes (distribution, scheduling, memory planning) see the whole step.
Each parameter's gradient passes through a ``raf_dist.mark_gradient`` marker right where
backward produces it; the optimizer reads the marked value. A distribution pass rewrites the
markers into collectives; without one, StripGradientMarkers removes them.
``opt_states`` are ordered parameter-major: for each parameter, each of the optimizer's
``state_names``. ``hypers`` are 0-d float tensors, one per ``optimizer.hyper_names``.
``loss_weight`` (0-d, only with ``build_train_step(loss_weight=True)``) multiplies the loss
before autodiff: under data parallelism with uneven batches it is local_rows * N / global_rows,
so the averaged loss and gradients are those of the global batch (training/batch_size.py).
``buffers`` are the model's buffers the forward writes (BatchNorm running statistics; no
gradient flows into them); the step returns their new values.
The function is written functionally (new values out); the ``raf_dist.updated_arguments``
attribute says which argument each output replaces, and the compiler (UpdateInPlace) makes the
compiled step write each new value into that argument's buffer, as torch.optim does, so the
step holds one copy of the parameters and optimizer state.

What is read off TVM's adjoint is training/adjoint.py's; the update, shared with the
pipeline's update step, is training/optimizer_update.py's.
"""
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import tvm
from tvm import relax

from ..ir.attrs import (LAYOUT_NUM_PARAMS, LAYOUT_PARAM_OFFSET, LAYOUT_STATES_PER_PARAM,
                        LOCAL_PARAMS, UPDATE_GROUPS, UPDATED_ARGUMENTS)
from ..model import Model, Shape, TensorSpec
from ..optim.optimizer import Optimizer
from ..passes.auto_cast import auto_cast
from ..passes.batch_norm import DecomposeBatchNorm, has_training_batch_norm
from ..passes.clipping import Clip
from ..passes.stage_split import strip_stage_markers
from ..passes.remat import ladder as remat_ladder
from ..passes.remat import rematerialize
from ..passes.saved_precision import save_low_precision
from ..passes.sequence_parallel import regather_in_backward
from . import gradients, gradients_spatial  # noqa: F401  (register the gradients TVM lacks)
from .adjoint import (follow_aliases, forward_length, loss_and_grads, missing_gradients,
                      parameter_casts, row_gradients)
from .cross_entropy import narrow_loss_input
from .layer_norm import read_16_bit_inputs
from .loss import build_loss
from .optimizer_update import (emit_update, identifier, in_param_dtypes, mark_in,
                               optimizer_groups, state_type)

@dataclasses.dataclass
class TrainStepSignature:
    """The calling convention of ``train_step`` (what the Trainer passes and receives)."""

    input_specs: List[TensorSpec]  # [(shape, dtype)] of the data inputs
    target_spec: TensorSpec  # (shape, dtype)
    param_names: List[str]
    param_specs: List[TensorSpec]  # [(shape, dtype)]
    state_names: List[str]  # per-parameter state names, e.g. ["exp_avg", "exp_avg_sq"]
    hyper_names: List[str]
    # [(shape, dtype, rate)]
    dropout_specs: List[Tuple[Shape, str, float]] = dataclasses.field(default_factory=list)
    buffer_names: List[str] = dataclasses.field(default_factory=list)  # carried between steps
    buffer_specs: List[TensorSpec] = dataclasses.field(default_factory=list)  # [(shape, dtype)]
    # frozen parameters (requires_grad=False): arguments after the dropout masks, before the
    # target; not differentiated, updated or communicated (their values never change)
    frozen_names: List[str] = dataclasses.field(default_factory=list)
    frozen_specs: List[TensorSpec] = dataclasses.field(default_factory=list)  # [(shape, dtype)]
    # dtype of the 0-d loss_weight argument after the target; None: the step takes none
    loss_weight_dtype: Optional[str] = None
    # with recomputation: passes/remat.ladder's (values, blocks), the points a memory budget
    # chooses among
    recompute_ladder: Tuple[int, int] = (0, 0)
    # the states kept one value per row (raf_dist.layout.state_shape): row-wise Adagrad's
    row_states: List[str] = dataclasses.field(default_factory=list)
    # the sharded tables updated in place on their looked-up rows: no whole gradient is
    # formed for them (their rows' gradients are the step's temporaries)
    sparse_names: List[str] = dataclasses.field(default_factory=list)
    # mixed precision with low_copies: [(trained parameter index, dtype)] of the 16-bit
    # copies the step takes after the buffers and (unless it only accumulates) writes anew
    # from the updated parameters
    low_copies: List[Tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def num_inputs(self) -> int:
        return len(self.input_specs)

    def state_keys(self) -> List[Tuple[str, str]]:
        """(param name, state name) for each opt_state argument, in order."""
        return [(p, s) for p in self.param_names for s in self.state_names]


ACCUMULATE = (None, "partial", "final")
#: the hyper that unscales the gradients under dynamic loss scaling (runtime/loss_scale.py)
GRAD_UNSCALE = "grad_unscale"


def build_train_step(model: Model, loss: str, optimizer: Optimizer,
                     target_spec: Optional[Sequence[Any]] = None,
                     nonfinite_guard: Optional[str] = None, loss_weight: bool = False,
                     tensor_parallel: bool = False, accumulate: Optional[str] = None,
                     compute_dtype: Optional[str] = None, reduce_dtype: Optional[str] = None,
                     loss_scale: bool = False, clip: Optional[Clip] = None,
                     recompute: Any = None,
                     local_grads: Optional[Tuple[Sequence[str], int, bool]] = None,
                     low_copies: bool = False) -> Tuple[tvm.IRModule, TrainStepSignature]:
    """Return (IRModule with "train_step", TrainStepSignature).

    ``loss_weight``: the step takes a 0-d ``loss_weight`` argument right after the target that
    multiplies the loss (and so every gradient) before autodiff.

    ``nonfinite_guard``: None, ``"gradients"`` or ``"gradients_and_loss"``: the update is
    skipped (parameters and optimizer state kept) and the loss returned as NaN when a
    gradient (or the loss) is not finite (training/nonfinite.py; not under ZeRO).
    ``tensor_parallel``: the model's forward is split across tp ranks (each holds other pieces
    of some gradients), so the guard's verdict is agreed across them.

    ``accumulate`` (gradient accumulation over microbatches, DESIGN.md 3c with P = 1):
    ``"partial"`` builds ``train_step(*inputs, *masks, *frozen, target, [loss_weight],
    *params, *grad_accs, loss_acc, *buffers) -> (loss_acc + loss, *grad_accs + grads,
    *new_buffers)``: forward and backward of one microbatch added into the accumulators, no
    marker, no update. ``"final"`` is the ordinary step with ``*grad_accs, loss_acc`` between
    the hypers and the buffers, added to the last microbatch's gradients (before their
    markers: the collectives reduce the sums) and loss.

    ``loss_scale`` (dynamic loss scaling, runtime/loss_scale.py): the step takes a
    ``loss_weight`` (the host passes weight x scale) and one more hyper, ``grad_unscale``
    (1 / scale), that multiplies every gradient right before its marker (the collectives
    reduce true gradients; the reduction is linear, an overflow stays inf).

    ``clip`` (a passes.clipping.Clip over the trained parameters): the gradients the
    optimizer reads are clipped by their global L2 norm and the loss output becomes
    [loss, norm]. Under ZeRO the distribution pass clips instead (give None here).

    ``recompute`` (None, ``"full"``, ``"selective"`` or one of a budget's points,
    ``remat.Cheapest`` / ``remat.FullBlocks``): the backward reads recomputed copies of the
    forward values the policy does not keep (passes/remat.py); the signature's
    ``recompute_ladder`` counts the budget's points.

    ``local_grads`` ((names, world, sparse) or None): the trained parameters whose gradient
    this rank computes whole for the dp group (embedding tables sharded over it: the
    exchange's backward already summed every rank's rows, passes/embedding_parallel.py).
    They get no marker (no collective reduces them) and are divided by ``world``, the average
    the allreduce gives the others; the non-finite verdict is then agreed over the dp group.
    ``sparse``: those whose optimizer is plain SGD are updated in place on their looked-up
    rows only (runtime/embedding_update.py; not with ``accumulate`` or ``loss_scale``).

    ``low_copies`` (with ``compute_dtype``): the 16-bit copy of each trained parameter the
    forward casts is an argument of the step, after the buffers, instead of a cast made in
    every step and held from the forward to the backward; the update writes the next step's
    copies from the new parameters (one more store in the optimizer's elementwise kernel, in
    place: Megatron-LM's and DeepSpeed's bf16 parameters beside float32 main ones). Gradients
    still reach the float32 parameters: the cast stays in the forward TVM differentiates,
    and only afterwards does each use of it read the argument (signature.low_copies)."""
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    if nonfinite_guard not in (None, "gradients", "gradients_and_loss"):
        raise ValueError(f"nonfinite_guard must be None, 'gradients' or 'gradients_and_loss', "
                         f"got {nonfinite_guard!r}")
    loss_weight = loss_weight or loss_scale
    forward, out_info = _training_forward(model, compute_dtype)
    n_buffers = len(getattr(model, "buffer_names", ()))
    target_shape, target_dtype = (None, None) if target_spec is None else target_spec
    loss_func, target_spec = build_loss(
        loss, [int(d) for d in out_info.shape], out_info.dtype, target_shape, target_dtype,
        weighted=loss_weight, vocab_parallel=getattr(model, "output_split_classes", 0) > 1)
    # the function's inputs: the data, then one mask per dropout (frontend/dropout.py)
    n_in = len(model.input_specs) + len(model.dropout_specs)
    trainable, frozen = _split_frozen(model)
    n_all = len(model.param_names)
    n_params = len(trainable)
    trains = [name not in frozen for name in model.param_names]
    adjoint, n_forward = _adjoint(forward, loss_func, n_in, trains)
    # recomputation rewrites only the backward's binding values: these stay the adjoint's
    loss_value, grads, new_buffers = loss_and_grads(adjoint)
    if compute_dtype is not None:  # the backward reads the forward's 16-bit copies
        adjoint = save_low_precision(adjoint, n_forward)
    recompute_ladder = (0, 0)
    if recompute is not None:
        recompute_ladder = remat_ladder(adjoint, n_forward, len(model.input_specs), loss_value)
        adjoint = rematerialize(adjoint, n_forward, len(model.input_specs), recompute,
                                loss_value)
    # sequence parallelism: the blocks' inputs gathered again in the backward, not kept
    adjoint = regather_in_backward(adjoint, n_forward)
    adjoint_params = adjoint.params[n_in:n_in + n_all]  # the adjoint's own Var objects
    param_vars = [v for v, t in zip(adjoint_params, trains) if t]
    buffer_vars = list(adjoint.params[n_in + n_all:n_in + n_all + n_buffers])
    casts = parameter_casts(adjoint, param_vars) if low_copies and compute_dtype else {}

    # frozen parameters are passed like data: after the dropout masks, before the target
    inputs = list(adjoint.params[:n_in]) + [v for v, t in zip(adjoint_params, trains) if not t]
    # AppendLoss puts the loss function's own arguments (target[, loss_weight]) last
    targets = list(adjoint.params[-2:] if loss_weight else adjoint.params[-1:])
    state_vars = [relax.Var(f"{identifier(p)}__{s}", state_type(v.ty, s, optimizer.row_states))
                  for p, v in zip(trainable, param_vars) for s in optimizer.state_names]
    specs = dict(zip(model.param_names, model.param_specs()))
    hyper_dtype = specs[trainable[0]][1]
    updaters, hyper_names, groups = optimizer_groups(optimizer, trainable)
    hyper_names += [GRAD_UNSCALE] if loss_scale else []
    hyper_vars = {h: relax.Var(h, relax.TensorType((), hyper_dtype)) for h in hyper_names}
    n_states = len(optimizer.state_names)

    bb = relax.BlockBuilder()
    acc_vars = [relax.Var(f"{identifier(p)}__grad_acc", v.ty)
                for p, v in zip(trainable, param_vars)]
    loss_acc = relax.Var("loss_acc", relax.TensorType((), hyper_dtype))
    if accumulate == "partial":
        params = inputs + targets + param_vars + acc_vars + [loss_acc] + buffer_vars
    elif accumulate == "final":
        params = (inputs + targets + param_vars + state_vars + list(hyper_vars.values())
                  + acc_vars + [loss_acc] + buffer_vars)
    else:
        params = (inputs + targets + param_vars + state_vars + list(hyper_vars.values())
                  + buffer_vars)
    # Gradient ends with `p_adjoint_out = p_adjoint` aliases in parameter order: follow them
    # to the binding backward really produces, so each marker sits where its gradient is made.
    value = {b.var: b.value for block in adjoint.body.blocks for b in block.bindings}
    grads = [follow_aliases(g, value) for g in grads]

    unscale = hyper_vars.get(GRAD_UNSCALE)
    local_names, dp_world, sparse_ok = local_grads if local_grads is not None else ((), 1, False)
    local = {i for i, n in enumerate(trainable) if n in set(local_names)}
    # tables updated sparsely: plain SGD, one update per step, the loss unscaled (the rows'
    # gradients are the update's whole input: training/embedding_parallel.py)
    sparse = {} if not sparse_ok or accumulate is not None or loss_scale else {
        i: pairs for i in sorted(local)
        if getattr(updaters[i][0], "updates_rows", False)
        for pairs in [row_gradients(grads[i], value, param_vars[i])] if pairs}
    # the 16-bit copies held between steps: {cast binding var: argument}, in parameter order
    low = [(i, var, dtype) for i, (var, dtype) in sorted(casts.items()) if i not in sparse]
    low_vars = [relax.Var(f"{identifier(trainable[i])}__{dtype}", var.ty)
                for i, var, dtype in low]
    params += low_vars
    read_copy = {var: arg for (_, var, _), arg in zip(low, low_vars)}

    def marked(grad: relax.Expr, i: int) -> relax.Expr:
        if i in sparse:  # its rows' gradients feed the update; this one is left unused
            return grad
        if unscale is not None:  # the loss was scaled: the gradients are too
            grad = bb.emit(relax.op.multiply(grad, unscale))
        if i in local:  # summed over the dp ranks by the exchange: their mean, unreduced
            return bb.emit(relax.op.multiply(grad, relax.const(1.0 / dp_world,
                                                               str(grad.ty.dtype))))
        return mark_in(bb, grad, i, reduce_dtype)

    def mark(grad: relax.Expr, i: int) -> relax.Expr:
        if accumulate is None:
            return marked(grad, i)
        total = bb.emit(relax.op.add(acc_vars[i], grad))
        return total if accumulate == "partial" else marked(total, i)

    with bb.function("train_step", params):
        with bb.dataflow():
            grads = in_param_dtypes(bb, _emit_backward(bb, adjoint, grads, mark, read_copy),
                                    param_vars)
            if accumulate == "partial":  # added into the accumulators; no update
                loss_sum = bb.emit(relax.op.add(loss_acc, loss_value))
                out = bb.emit_output(relax.Tuple([loss_sum, *grads, *new_buffers]))
            else:
                if accumulate == "final":
                    loss_value = bb.emit(relax.op.add(loss_acc, loss_value))
                rows = {i: _rows_of(bb, pairs, dp_world) for i, pairs in sparse.items()}
                out = emit_update(bb, updaters, grads, loss_value, param_vars, state_vars,
                                  hyper_vars, new_buffers, nonfinite_guard, tensor_parallel,
                                  clip, across_dp=bool(local) and dp_world > 1,
                                  sparse_rows=rows, low=[(i, d) for i, _, d in low])
        bb.emit_func_output(out)
    step_mod = bb.get()
    if compute_dtype is not None:  # layer norms' gradients read the bf16 tensors as they are
        step_mod["train_step"] = read_16_bit_inputs(step_mod["train_step"])
    attrs = _layout_attrs(accumulate, len(inputs) + len(targets), n_params, n_states,
                          len(params) - len(low_vars), n_buffers)
    if low_vars and accumulate != "partial":  # the outputs after the buffers: the new copies
        attrs[UPDATED_ARGUMENTS] = list(attrs[UPDATED_ARGUMENTS]) + list(
            range(len(params) - len(low_vars), len(params)))
    if len(set(groups)) > 1:
        attrs[UPDATE_GROUPS] = groups
    if local and accumulate != "partial":
        attrs[LOCAL_PARAMS] = sorted(local)
    step_mod["train_step"] = step_mod["train_step"].with_attrs(attrs)
    step_mod = relax.transform.DeadCodeElimination(["train_step"])(step_mod)
    signature = _signature(model, target_spec, trainable, specs, optimizer, frozen,
                           loss_weight, out_info, hyper_names)
    return step_mod, dataclasses.replace(signature, recompute_ladder=recompute_ladder,
                                         sparse_names=[trainable[i] for i in sorted(sparse)],
                                         low_copies=[(i, d) for i, _, d in low])


def _training_forward(model: Model, compute_dtype: Optional[str] = None
                      ) -> Tuple[relax.Function, relax.TensorType]:
    """(forward, the type of the output the loss reads): stage markers stripped (they
    matter only to pipelining), training batch norm decomposed, the compute cast to
    ``compute_dtype`` (mixed precision), every op differentiable."""
    forward = strip_stage_markers(model.forward)
    if has_training_batch_norm(tvm.IRModule({tvm.ir.GlobalVar("forward"): forward})):
        # the Trainer decomposes it first when batch norm is synchronized across ranks
        # (module_pass makes the class a pass factory, which mypy does not see)
        decompose: Any = DecomposeBatchNorm()
        forward = decompose(tvm.IRModule({tvm.ir.GlobalVar("forward"): forward}))["forward"]
    if compute_dtype is not None:
        forward = auto_cast(forward, compute_dtype)
    out_info = forward.ret_ty
    if getattr(model, "buffer_names", ()):  # (output, *new buffer values): frontend/buffers.py
        out_info = out_info.fields[0]
    if not isinstance(out_info, relax.TensorType) or out_info.shape is None:
        raise ValueError(f"{model.source}: forward must return one tensor of known shape to "
                         f"apply a loss, got {out_info}")
    missing = missing_gradients(forward)
    if missing:
        ops = ", ".join(f"{op} (computing {var})" for op, var in missing)
        raise NotImplementedError(
            f"{model.source}: no gradient is registered for {ops}; register one with "
            "tvm.relax.op.base.register_gradient or avoid the op")
    return forward, out_info


def _adjoint(forward: relax.Function, loss_func: relax.Function, n_in: int,
             trains: Sequence[bool]) -> Tuple[relax.Function, int]:
    """TVM's adjoint of ``loss_func(forward(...))``: gradients of the parameters whose
    ``trains`` flag is set (never of the data, the frozen parameters or the buffers); and
    how many of its leading bindings are the forward and the loss (the backward follows)."""
    mod = tvm.IRModule({tvm.ir.GlobalVar("main"): forward.with_attr("global_symbol", "main")})
    mod = relax.training.AppendLoss("main", loss_func, num_backbone_outputs=1)(mod)
    mod["main_loss"] = narrow_loss_input(mod["main_loss"])
    forward_params = mod["main_loss"].params[n_in:n_in + len(trains)]
    require = [v for v, t in zip(forward_params, trains) if t]
    mod = relax.transform.Gradient("main_loss", require_grads=require)(mod)
    adjoint = mod["main_loss_adjoint"]
    return adjoint, forward_length(adjoint)


def _layout_attrs(accumulate: Optional[str], first: int, n_params: int, n_states: int,
                  n_args: int, n_buffers: int) -> Dict[str, Any]:
    """Where the parameters and optimizer states sit among the arguments (``first``: the
    first parameter's index), for the passes that change how they are held (ZeRO shards
    them), and which argument each output updates."""
    buffers_updated = list(range(n_args - n_buffers, n_args))
    if accumulate == "partial":  # outputs: the accumulators (after the parameters), buffers
        return {UPDATED_ARGUMENTS: list(range(first + n_params, first + 2 * n_params))
                + buffers_updated}
    return {LAYOUT_PARAM_OFFSET: first, LAYOUT_NUM_PARAMS: n_params,
            LAYOUT_STATES_PER_PARAM: n_states,
            UPDATED_ARGUMENTS: list(range(first, first + n_params * (1 + n_states)))
            + buffers_updated}


def _emit_backward(bb: relax.BlockBuilder, adjoint: relax.Function,
                   grads: Sequence[relax.Expr], mark: Callable[[relax.Expr, int], relax.Expr],
                   read_copy: Optional[Dict[relax.Var, relax.Var]] = None
                   ) -> List[relax.Expr]:
    """The adjoint's bindings, each gradient passed through ``mark(grad, i)`` the moment it
    is produced (backward order: distribution passes turn markers into collectives);
    returns the marked gradients in parameter order. ``read_copy`` {a parameter's cast:
    the argument holding that copy}: the cast's binding reads the argument instead."""
    index = {g: i for i, g in enumerate(grads) if isinstance(g, relax.Var)}
    marked: List[Optional[relax.Expr]] = [None] * len(grads)
    read_copy = read_copy or {}
    for block in adjoint.body.blocks:
        for binding in block.bindings:
            if binding.var in read_copy:
                binding = relax.VarBinding(binding.var, read_copy[binding.var])
            bb.emit_normalized(binding)
            i = index.get(binding.var)
            if i is not None:
                marked[i] = mark(binding.var, i)
    for i, grad in enumerate(grads):
        if marked[i] is None:  # not computed by a binding (e.g. a constant zero)
            marked[i] = mark(grad, i)
    return marked


def hyper_arguments(optimizer: Optimizer, names: Sequence[str]) -> List[str]:
    """The hyper arguments of a step updating parameters ``names`` (their groups' hypers)."""
    return optimizer_groups(optimizer, names)[1]


def _rows_of(bb: relax.BlockBuilder, pairs: Sequence[Tuple[relax.Expr, relax.Expr]],
             dp_world: int) -> Tuple[relax.Expr, relax.Expr]:
    """(ids, rows): a table's lookups' ids and their rows' gradients, one tensor each, the
    gradients divided by ``dp_world`` as the other local gradients are."""
    ids = [p[0] for p in pairs]
    rows = [p[1] for p in pairs]
    ids = ids[0] if len(ids) == 1 else bb.emit(relax.op.concat(ids, axis=0))
    rows = rows[0] if len(rows) == 1 else bb.emit(relax.op.concat(rows, axis=0))
    if dp_world > 1:
        rows = bb.emit(relax.op.multiply(rows, relax.const(1.0 / dp_world,
                                                           str(rows.ty.dtype))))
    return ids, rows


def _signature(model: Model, target_spec: Sequence[Any], trainable: List[str],
               specs: Dict[str, TensorSpec], optimizer: Optimizer, frozen: Set[str],
               loss_weight: bool, out_info: relax.TensorType,
               hyper_names: Sequence[str]) -> TrainStepSignature:
    return TrainStepSignature(
        input_specs=list(model.input_specs), target_spec=tuple(target_spec),
        param_names=trainable, param_specs=[specs[n] for n in trainable],
        state_names=list(optimizer.state_names), hyper_names=list(hyper_names),
        row_states=list(optimizer.row_states),
        dropout_specs=list(model.dropout_specs),
        frozen_names=[n for n in model.param_names if n in frozen],
        frozen_specs=[specs[n] for n in model.param_names if n in frozen],
        buffer_names=list(getattr(model, "buffer_names", ())),
        buffer_specs=model.buffer_specs() if getattr(model, "buffer_names", ()) else [],
        loss_weight_dtype=str(out_info.dtype) if loss_weight else None)


def _split_frozen(model: Model) -> Tuple[List[str], Set[str]]:
    """(trainable parameter names in order, set of frozen names) of ``model``."""
    frozen = set(getattr(model, "frozen_params", ()))
    unknown = sorted(frozen - set(model.param_names))
    if unknown:
        raise ValueError(f"{model.source}: frozen_params names {unknown}, which are not among "
                         f"its parameters {list(model.param_names)}")
    trainable = [n for n in model.param_names if n not in frozen]
    if not trainable:
        raise ValueError(f"{model.source}: every parameter is frozen (requires_grad=False); "
                         "there is nothing to train. Unfreeze at least one parameter")
    return trainable, frozen
