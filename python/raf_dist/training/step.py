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
"""
import dataclasses

import tvm
from tvm import relax

from ..ir.attrs import (LAYOUT_NUM_PARAMS, LAYOUT_PARAM_OFFSET, LAYOUT_STATES_PER_PARAM,
                        LOCAL_PARAMS, UPDATE_GROUPS, UPDATED_ARGUMENTS)
from ..ir.ops import EMBEDDING_ROWS_SQUARES as ROWS_SQUARES
from ..ir.ops import mark_gradient
from ..layout.state import state_shape
from ..optim import group_hyper_name
from ..passes import clipping
from ..passes.auto_cast import LOW_DTYPES, auto_cast
from ..passes.batch_norm import DecomposeBatchNorm, has_training_batch_norm
from ..passes.pipeline import strip_stage_markers
from ..passes.remat import ladder as remat_ladder
from ..passes.remat import rematerialize
from ..passes.saved_precision import save_low_precision
from . import gradients, gradients_spatial  # noqa: F401  (register the gradients TVM lacks)
from . import nonfinite
from .cross_entropy import narrow_loss_input
from .layer_norm import read_16_bit_inputs
from .loss import build_loss


@dataclasses.dataclass
class TrainStepSignature:
    """The calling convention of ``train_step`` (what the Trainer passes and receives)."""

    input_specs: list  # [(shape, dtype)] of the data inputs
    target_spec: tuple  # (shape, dtype)
    param_names: list
    param_specs: list  # [(shape, dtype)]
    state_names: list  # per-parameter state names, e.g. ["exp_avg", "exp_avg_sq"]
    hyper_names: list
    dropout_specs: list = dataclasses.field(default_factory=list)  # [(shape, dtype, rate)]
    buffer_names: list = dataclasses.field(default_factory=list)  # carried between steps
    buffer_specs: list = dataclasses.field(default_factory=list)  # [(shape, dtype)]
    # frozen parameters (requires_grad=False): arguments after the dropout masks, before the
    # target; not differentiated, updated or communicated (their values never change)
    frozen_names: list = dataclasses.field(default_factory=list)
    frozen_specs: list = dataclasses.field(default_factory=list)  # [(shape, dtype)]
    # dtype of the 0-d loss_weight argument after the target; None: the step takes none
    loss_weight_dtype: str = None
    # with recomputation: passes/remat.ladder's (values, blocks), the points a memory budget
    # chooses among
    recompute_ladder: tuple = (0, 0)
    # the states kept one value per row (raf_dist.layout.state_shape): row-wise Adagrad's
    row_states: list = dataclasses.field(default_factory=list)
    # the sharded tables updated in place on their looked-up rows: no whole gradient is
    # formed for them (their rows' gradients are the step's temporaries)
    sparse_names: list = dataclasses.field(default_factory=list)
    # mixed precision with low_copies: [(trained parameter index, dtype)] of the 16-bit
    # copies the step takes after the buffers and (unless it only accumulates) writes anew
    # from the updated parameters
    low_copies: list = dataclasses.field(default_factory=list)

    @property
    def num_inputs(self):
        return len(self.input_specs)

    def state_keys(self):
        """(param name, state name) for each opt_state argument, in order."""
        return [(p, s) for p in self.param_names for s in self.state_names]


def missing_gradients(func):
    """Ops in ``func`` that have no registered gradient: [(op name, bound var name)].
    Integer/bool computations (masks, positions) need none (gradients.has_gradient)."""
    missing = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if not gradients.has_gradient(expr):
                missing.append(expr.op.name)

    for block in func.body.blocks:
        for binding in block.bindings:
            before = len(missing)
            relax.analysis.post_order_visit(binding.value, visit)
            missing[before:] = [(name, binding.var.name) for name in missing[before:]]
    return missing


ACCUMULATE = (None, "partial", "final")
#: the hyper that unscales the gradients under dynamic loss scaling (runtime/loss_scale.py)
GRAD_UNSCALE = "grad_unscale"


def build_train_step(model, loss, optimizer, target_spec=None, nonfinite_guard=None,
                     loss_weight=False, tensor_parallel=False, accumulate=None,
                     compute_dtype=None, reduce_dtype=None, loss_scale=False, clip=None,
                     recompute=None, local_grads=None, low_copies=False):
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
    loss_value, grads, new_buffers = _loss_and_grads(adjoint)
    if compute_dtype is not None:  # the backward reads the forward's 16-bit copies
        adjoint = save_low_precision(adjoint, n_forward)
    recompute_ladder = (0, 0)
    if recompute is not None:
        recompute_ladder = remat_ladder(adjoint, n_forward, len(model.input_specs), loss_value)
        adjoint = rematerialize(adjoint, n_forward, len(model.input_specs), recompute,
                                loss_value)
    adjoint_params = adjoint.params[n_in:n_in + n_all]  # the adjoint's own Var objects
    param_vars = [v for v, t in zip(adjoint_params, trains) if t]
    buffer_vars = list(adjoint.params[n_in + n_all:n_in + n_all + n_buffers])
    casts = _parameter_casts(adjoint, param_vars) if low_copies and compute_dtype else {}

    # frozen parameters are passed like data: after the dropout masks, before the target
    inputs = list(adjoint.params[:n_in]) + [v for v, t in zip(adjoint_params, trains) if not t]
    # AppendLoss puts the loss function's own arguments (target[, loss_weight]) last
    targets = list(adjoint.params[-2:] if loss_weight else adjoint.params[-1:])
    state_vars = [relax.Var(f"{_ident(p)}__{s}", state_type(v.ty, s, optimizer.row_states))
                  for p, v in zip(trainable, param_vars) for s in optimizer.state_names]
    specs = dict(zip(model.param_names, model.param_specs()))
    hyper_dtype = specs[trainable[0]][1]
    updaters, hyper_names, groups = _groups(optimizer, trainable)
    hyper_names += [GRAD_UNSCALE] if loss_scale else []
    hyper_vars = {h: relax.Var(h, relax.TensorType((), hyper_dtype)) for h in hyper_names}
    n_states = len(optimizer.state_names)

    bb = relax.BlockBuilder()
    acc_vars = [relax.Var(f"{_ident(p)}__grad_acc", v.ty) for p, v in zip(trainable, param_vars)]
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
    grads = [_follow(g, value) for g in grads]

    unscale = hyper_vars.get(GRAD_UNSCALE)
    local_names, dp_world, sparse_ok = local_grads if local_grads is not None else ((), 1, False)
    local = {i for i, n in enumerate(trainable) if n in set(local_names)}
    # tables updated sparsely: plain SGD, one update per step, the loss unscaled (the rows'
    # gradients are the update's whole input: training/embedding_parallel.py)
    sparse = {} if not sparse_ok or accumulate is not None or loss_scale else {
        i: pairs for i in sorted(local)
        if getattr(updaters[i][0], "updates_rows", False)
        for pairs in [_row_gradients(grads[i], value, param_vars[i])] if pairs}
    # the 16-bit copies held between steps: {cast binding var: argument}, in parameter order
    low = [(i, var, dtype) for i, (var, dtype) in sorted(casts.items()) if i not in sparse]
    low_vars = [relax.Var(f"{_ident(trainable[i])}__{dtype}", var.ty) for i, var, dtype in low]
    params += low_vars
    read_copy = {var: arg for (_, var, _), arg in zip(low, low_vars)}

    def marked(grad, i):
        if i in sparse:  # its rows' gradients feed the update; this one is left unused
            return grad
        if unscale is not None:  # the loss was scaled: the gradients are too
            grad = bb.emit(relax.op.multiply(grad, unscale))
        if i in local:  # summed over the dp ranks by the exchange: their mean, unreduced
            return bb.emit(relax.op.multiply(grad, relax.const(1.0 / dp_world,
                                                               str(grad.ty.dtype))))
        return mark_in(bb, grad, i, reduce_dtype)

    def mark(grad, i):
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
                out = _emit_update(bb, updaters, grads, loss_value, param_vars, state_vars,
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


def _training_forward(model, compute_dtype=None):
    """(forward, the type of the output the loss reads): stage markers stripped (they
    matter only to pipelining), training batch norm decomposed, the compute cast to
    ``compute_dtype`` (mixed precision), every op differentiable."""
    forward = strip_stage_markers(model.forward)
    if has_training_batch_norm(tvm.IRModule({tvm.ir.GlobalVar("forward"): forward})):
        # the Trainer decomposes it first when batch norm is synchronized across ranks
        forward = DecomposeBatchNorm()(tvm.IRModule({tvm.ir.GlobalVar("forward"): forward}))[
            "forward"]
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


def _adjoint(forward, loss_func, n_in, trains):
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
    return adjoint, _forward_length(adjoint)


def _forward_length(adjoint):
    """How many of the adjoint's leading bindings are the forward and the loss: up to the
    binding of the loss it returns (and of the new buffers returned beside it). Counted on
    the adjoint, not on the function Gradient read: Gradient drops the forward's unused
    bindings (an AutoCast forward had 369, its adjoint 339 before the backward began)."""
    bindings = [b for block in adjoint.body.blocks for b in block.bindings]
    position = {b.var: i for i, b in enumerate(bindings)}
    bound = {b.var: b.value for b in bindings}
    outputs = [_unwrap(adjoint.body.body, bound).fields[0]]
    last = -1
    while outputs:
        value = outputs.pop()
        if isinstance(value, relax.Tuple):
            outputs.extend(value.fields)
        elif isinstance(value, relax.Var) and value in position:
            last = max(last, position[value])
            if isinstance(bound[value], (relax.Tuple, relax.Var)):  # (loss, *new buffers)
                outputs.append(bound[value])
    return last + 1


def _layout_attrs(accumulate, first, n_params, n_states, n_args, n_buffers):
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


def _emit_backward(bb, adjoint, grads, mark, read_copy=None):
    """The adjoint's bindings, each gradient passed through ``mark(grad, i)`` the moment it
    is produced (backward order: distribution passes turn markers into collectives);
    returns the marked gradients in parameter order. ``read_copy`` {a parameter's cast:
    the argument holding that copy}: the cast's binding reads the argument instead."""
    index = {g: i for i, g in enumerate(grads) if isinstance(g, relax.Var)}
    marked = [None] * len(grads)
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


_ASTYPE = tvm.ir.Op.get("relax.astype")


def _parameter_casts(adjoint, param_vars):
    """{trained parameter index: (the binding var of its cast to a 16-bit float, dtype)}: the
    copies AutoCast made of the parameters themselves (one per parameter and dtype; a
    parameter cast to two 16-bit dtypes, which AutoCast never does, keeps its casts).

    Matrices and kernels only (two axes or more): their copies are the bytes (the forward
    keeps them for the backward's products), and their casts are kernels of their own that
    round to nearest even, as the host's cast does. A vector's cast (a bias, a norm's
    scale) costs nothing held, and FuseOps fuses it into the elementwise kernel reading it,
    where TVM's bf16 legalisation drops the rounding (the add reads the float32 value);
    a copy would round it and change the step's arithmetic."""
    index = {v: i for i, v in enumerate(param_vars)}
    found, seen = {}, set()
    for block in adjoint.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not (isinstance(value, relax.Call) and value.op.same_as(_ASTYPE)
                    and value.args[0] in index):
                continue
            i, dtype = index[value.args[0]], str(binding.var.ty.dtype)
            if dtype not in LOW_DTYPES or len(binding.var.ty.shape) < 2:
                continue
            if i in seen:  # a second cast of the same parameter: leave both in the step
                found.pop(i, None)
                continue
            seen.add(i)
            found[i] = (binding.var, dtype)
    return found


def _groups(optimizer, names):
    """(per parameter: (its group's optimizer, {hyper name: step argument name}); the hyper
    arguments of the groups in use, in order; each parameter's group index). The Trainer
    checked that every pattern matches a parameter of the whole model."""
    members = optimizer.groups()
    index = optimizer.assign(names, check=False)
    hyper_names = [group_hyper_name(g, h) for g in sorted(set(index))
                   for h in members[g].hyper_names]
    updaters = [(members[g], {h: group_hyper_name(g, h) for h in members[g].hyper_names})
                for g in index]
    return updaters, hyper_names, index


def mark_in(bb, grad, i, reduce_dtype):
    """Gradient ``i``'s marker, the gradient cast to ``reduce_dtype`` first when it is
    reduced in another dtype (Trainer(grad_reduce_dtype="bfloat16"): half the bytes)."""
    if reduce_dtype is not None and str(grad.ty.dtype) != reduce_dtype:
        grad = bb.emit(relax.op.astype(grad, reduce_dtype))
    return bb.emit(mark_gradient(grad, i))


def in_param_dtypes(bb, grads, params):
    """The marked ``grads`` back in their parameters' dtypes, cast after every marker (the
    distribution passes reduce each bucket before its first reader)."""
    return [g if str(g.ty.dtype) == str(p.ty.dtype)
            else bb.emit(relax.op.astype(g, str(p.ty.dtype))) for g, p in zip(grads, params)]


def hyper_arguments(optimizer, names):
    """The hyper arguments of a step updating parameters ``names`` (their groups' hypers)."""
    return _groups(optimizer, names)[1]


_TAKE_BACKWARD = tvm.ir.Op.get("relax.grad.take_backward")
_ADD = tvm.ir.Op.get("relax.add")


def _row_gradients(grad, value, param):
    """[(ids, rows)] when ``grad`` (the adjoint's gradient of table ``param``) is a sum of
    take_backward(rows, param, ids, axis=0) scatter-adds (its lookups' gradients); else
    None."""
    bound = value.get(grad) if isinstance(grad, relax.Var) else None
    if isinstance(bound, relax.Var):
        return _row_gradients(bound, value, param)
    if not isinstance(bound, relax.Call):
        return None
    if bound.op.same_as(_TAKE_BACKWARD) and bound.args[1].same_as(param) \
            and bound.attrs.axis is not None and int(bound.attrs.axis) == 0:
        return [(bound.args[2], bound.args[0])]
    if bound.op.same_as(_ADD):
        parts = [_row_gradients(a, value, param) for a in bound.args]
        return None if None in parts else parts[0] + parts[1]
    return None


def _rows_of(bb, pairs, dp_world):
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


def _emit_update(bb, updaters, grads, loss_value, param_vars, state_vars, hyper_vars,
                 new_buffers, nonfinite_guard, tensor_parallel, clip=None, across_dp=False,
                 sparse_rows=None, low=()):
    """The optimizer's update of every parameter (skipped on a non-finite step when guarded;
    ``clip``, a passes.clipping.Clip: the gradients clipped first); returns the step's output
    tuple (loss or [loss, norm], *params, *states, *buffers, *16-bit copies of ``low``'s
    parameters). ``across_dp``: the verdict
    is agreed over the dp group (some gradients are this rank's alone). ``sparse_rows`` {parameter
    index: (ids, rows' gradients)}: those tables updated in place on the looked-up rows only
    (the optimizer's ``emit_row_update``: runtime/embedding_update.py); the non-finite check
    reads their rows."""
    sparse_rows = sparse_rows or {}
    norm = None
    if clip is not None:  # a sparsely updated table counts (and scales) its rows
        squares = [bb.emit(relax.call_pure_packed(ROWS_SQUARES, ids, rows,
                                                  ty_args=relax.TensorType((), "float32")))
                   for ids, rows in sparse_rows.values()]
        total = squares[0] if squares else None
        for term in squares[1:]:
            total = bb.emit(relax.op.add(total, term))
        norm = clipping.global_norm(
            bb, [None if i in sparse_rows else g for i, g in enumerate(grads)], clip, total)
        coef = clipping.clip_coefficient(bb, norm, clip.max_norm)
        clipped = [g if i in sparse_rows else clipping.scaled(bb, g, coef)
                   for i, g in enumerate(grads)]
        rows_of = {i: (ids, clipping.scaled(bb, rows, coef))
                   for i, (ids, rows) in sparse_rows.items()}
    flag = None
    if nonfinite_guard:
        flag = nonfinite.finite_flag(
            bb, [sparse_rows[i][1] if i in sparse_rows else g for i, g in enumerate(grads)],
            loss_value if nonfinite_guard == "gradients_and_loss" else None,
            across_tp=tensor_parallel, across_dp=across_dp)
    n_states = len(updaters[0][0].state_names) if updaters else 0
    keep = (None if flag is None else
            lambda new, old: nonfinite.keep_unless(bb, flag, new, old))
    if norm is not None:
        grads, sparse_rows = clipped, rows_of
    new_params, new_states = [], []
    for i, (param, grad) in enumerate(zip(param_vars, grads)):
        states = state_vars[i * n_states:(i + 1) * n_states]
        optimizer, arguments = updaters[i]  # the parameter's group
        if i in sparse_rows:  # in place, the looked-up rows only (runtime/embedding_update.py)
            ids, rows = sparse_rows[i]
            new_param, updated = optimizer.emit_row_update(
                bb, param, states, ids, rows, {h: hyper_vars[a] for h, a in arguments.items()},
                flag if flag is not None else relax.const(True, "bool"))
            new_params.append(new_param)
            new_states.extend(updated)
            continue
        # the states are kept (or not) where they are computed: optimizer.emit_update
        new_param, updated = optimizer.emit_update(
            bb, param, grad, states, {h: hyper_vars[a] for h, a in arguments.items()},
            keep=keep)
        if flag is not None:
            new_param = nonfinite.keep_unless(bb, flag, new_param, param)
        new_params.append(new_param)
        new_states.extend(updated)
    if norm is not None:
        loss_value = clipping.with_norm(bb, loss_value, norm)
    if flag is not None:
        loss_value = nonfinite.flag_loss(bb, flag, loss_value)
    # the next step's 16-bit copies (``low``: [(parameter index, dtype)]), cast from the new
    # parameters: FuseOps puts each cast in its parameter's update kernel
    copies = [bb.emit(relax.op.astype(new_params[i], dtype)) for i, dtype in low]
    return bb.emit_output(relax.Tuple([loss_value, *new_params, *new_states, *new_buffers,
                                       *copies]))


def _signature(model, target_spec, trainable, specs, optimizer, frozen, loss_weight, out_info,
               hyper_names):
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


def _follow(var, value):
    """Through ``a = b`` aliases (``value``: each bound variable's value) to the binding that
    computes ``var``."""
    while isinstance(var, relax.Var) and isinstance(value.get(var), relax.Var):
        var = value[var]
    return var


def _loss_and_grads(adjoint):
    """The adjoint function returns (loss, (grad, ...)), or ((loss, *new buffers), (grad,
    ...)) for a forward that updates buffers; find those expressions."""
    bound = {b.var: b.value for block in adjoint.body.blocks for b in block.bindings}
    loss_value, grads = _unwrap(adjoint.body.body, bound).fields
    grads = _unwrap(grads, bound)
    new_buffers = []
    if isinstance(loss_value.ty, relax.TupleType):
        loss_value, *new_buffers = _unwrap(loss_value, bound).fields
    return loss_value, list(grads.fields), new_buffers


def _unwrap(expr, bound):
    """``expr`` through the variables ``bound`` binds it to, down to the value."""
    while isinstance(expr, relax.Var) and expr in bound:
        expr = bound[expr]
    return expr


def _split_frozen(model):
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


def state_type(param_type, state, row_states):
    """The Relax type of optimizer state ``state`` of a parameter of ``param_type``: the
    parameter's, or one value per row (raf_dist.layout.state_shape)."""
    shape = [int(d) for d in param_type.shape]
    return relax.TensorType(state_shape(shape, state, row_states), param_type.dtype)


def _ident(name):
    return "".join(c if c.isalnum() else "_" for c in name)
