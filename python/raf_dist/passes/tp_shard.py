"""shard_forward: the forward rewritten to one tp rank's share of it (DESIGN.md 3b), from the
placements plan_tensor_parallel (tensor_parallel.py) found.

Input: the forward before autodiff and its TensorParallelPlan (tp_plan.py). Output: the
same function in which split parameters take their local shapes, shapes in reshape /
broadcast_to / split become the local ones, f (tp_copy) wraps each replicated value a split
region reads when a gradient flows through it, g (tp_reduce) follows each row-parallel
matmul, a split embedding looks up only this rank's rows, and the padded classes of a padded
vocabulary are masked where the logits leave the forward. Only tensor shapes change; the
function stays SPMD (which slice a rank holds is decided when the Trainer loads parameters).
"""
from tvm import relax

from .gradient_markers import substitute
from .tensor_parallel import first_output, values_needing_grad, vars_by_name
from .tp_layout import PARTIAL, field_shapes, local_shape, propagate, static_shape
from .tp_ops import tp_copy, tp_rank, tp_reduce
from .tp_padding import mask_padded_classes, pad_forward


def shard_forward(func, tp, param_names, trained, plan):
    """``func`` with the placements of ``plan`` (a TensorParallelPlan) applied."""
    classes = None  # the true classes of a padded output, whose padding is masked
    if plan.padding:
        by_name = vars_by_name(func, param_names)
        true_classes = static_shape(first_output(func))[-1]
        func = pad_forward(func, {by_name[n]: p for n, p in plan.padding.items()},
                           plan.output_split)
        if plan.output_split and static_shape(first_output(func))[-1] != true_classes:
            classes = true_classes
    masked = first_output(func) if classes is not None else None  # the binding to mask
    by_name = vars_by_name(func, param_names)
    placements = {}
    for name, p in plan.placements.items():
        var = by_name[name]
        placements[var] = (p.dim, static_shape(var)[p.dim] // p.segments)
    needs_grad = values_needing_grad(func, [by_name[n] for n in trained if n in by_name])
    result = propagate(func, tp, placements, set(by_name.values()), needs_grad,
                       plan.output_split)
    layouts = dict(result.layouts)
    vocab = result.vocab_takes
    layouts.update({v: PARTIAL for v in result.partials})
    var_map = {}
    new_params = []
    for p in func.params:
        if p in layouts:
            shape = local_shape(static_shape(p), layouts[p], tp)
            var_map[p] = relax.Var(p.name, relax.TensorType(shape, p.ty.dtype))
        else:
            var_map[p] = p
        new_params.append(var_map[p])
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    if masked is not None and masked not in bound:
        raise AssertionError("the padded output classes are not bound in the forward")
    bb = relax.BlockBuilder()
    attrs = dict(func.attrs) if func.attrs is not None else {}
    name = str(attrs.pop("global_symbol", "forward"))

    def emit(b, copies, output=False):
        if masked is None or not b.var.same_as(masked):
            return _rewrite(bb, b, tp, layouts, copies, var_map, vocab, output=output)
        logits = mask_padded_classes(bb, _rewrite(bb, b, tp, layouts, copies, var_map, vocab),
                                     classes)
        var_map[b.var] = (bb.emit_output(logits, name_hint=b.var.name) if output else
                          bb.emit(logits, name_hint=b.var.name))
        return var_map[b.var]

    with bb.function(name, new_params, attrs=attrs, pure=True):
        for block in func.body.blocks:
            if isinstance(block, relax.DataflowBlock):
                with bb.dataflow():
                    copies = _Copies(bb, result.copies, var_map, bound)
                    for b in block.bindings:
                        emit(b, copies, output=not isinstance(b.var, relax.DataflowVar))
            else:
                copies = _Copies(bb, result.copies, var_map, bound)
                for b in block.bindings:
                    emit(b, copies)
        bb.emit_func_output(substitute(func.body.body, var_map))
    return bb.get()[name]


class _Copies:
    """f for each replicated operand of a split op: one tp_copy per root value (a block's
    worth), then the operand's own reshapes / casts again on the copy."""

    def __init__(self, bb, needed, var_map, bound):
        self.bb, self.needed, self.var_map, self.bound = bb, needed, var_map, bound
        self.done = {}

    def __contains__(self, var):
        return var in self.needed

    def __getitem__(self, var):
        if var in self.done:
            return self.done[var]
        root = self.needed[var]
        if var.same_as(root):
            new = self.bb.emit(tp_copy(self.var_map.get(root, root)), name_hint=f"{root.name}_tp")
        else:
            value = self.bound[var]
            inner = value.args[0]
            self.needed.setdefault(inner, root)
            rest = [substitute(a, self.var_map) for a in value.args[1:]]
            new = self.bb.emit(relax.Call(value.op, [self[inner], *rest], value.attrs,
                                          value.ty_args), name_hint=f"{var.name}_tp")
        self.done[var] = new
        return new


def _rewrite(bb, binding, tp, layouts, copies, var_map, vocab, output=False):
    var, value = binding.var, binding.value
    hi = layouts.get(var)
    if isinstance(value, relax.Call) and hasattr(value.op, "name"):
        args = []
        split_op = hi is not None or any(layouts.get(a, PARTIAL) != PARTIAL
                                         for a in value.args if isinstance(a, relax.Var))
        for a in value.args:
            if (split_op and isinstance(a, relax.Var) and a in copies
                    and layouts.get(a, PARTIAL) == PARTIAL):
                args.append(copies[a])
            else:
                args.append(substitute(a, var_map))
        new = (_vocab_lookup(bb, value, args) if var in vocab else
               _local_call(value, args, var, hi, tp))
    else:
        new = substitute(value, var_map)
    if hi == PARTIAL:  # this rank's partial sum, then g
        new = tp_reduce(bb.emit(new, name_hint=var.name + "_partial"))
    emitted = bb.emit_output(new, name_hint=var.name) if output else bb.emit(
        new, name_hint=var.name)
    _check_local(var, emitted, layouts, tp)
    var_map[var] = emitted
    return emitted


def _vocab_lookup(bb, call, args):
    """take(table piece, ids): the rows of ids in this rank's range [r * V/T, (r+1) * V/T),
    zeros elsewhere (g then sums the ranks' pieces: Megatron's VocabParallelEmbedding)."""
    op = relax.op
    table, ids = args[0], args[1]
    axis = int(call.attrs.axis) % len(static_shape(table))
    rows = static_shape(table)[axis]
    dtype = str(ids.ty.dtype)
    rank = bb.emit(tp_rank(ids))
    start = bb.emit(op.astype(op.multiply(rank, relax.const(rows, "int64")), dtype))
    local = bb.emit(op.subtract(ids, start))
    inside = bb.emit(op.logical_and(op.greater_equal(local, relax.const(0, dtype)),
                                    op.less(local, relax.const(rows, dtype))))
    safe = bb.emit(op.where(inside, local, relax.const(0, dtype)))
    looked_up = bb.emit(relax.Call(call.op, [table, safe], call.attrs, call.ty_args))
    keep = inside
    for _ in range(len(static_shape(table)) - 1 - axis):
        keep = bb.emit(op.expand_dims(keep, [-1]))
    return op.where(keep, looked_up, relax.const(0.0, str(table.ty.dtype)))


def _local_call(call, args, var, hi, tp):
    name = call.op.name
    if hi is None or hi == PARTIAL:
        return relax.Call(call.op, args, call.attrs, call.ty_args)
    shape = local_shape(static_shape(var), hi, tp) if not isinstance(hi, tuple) else None
    if name in ("relax.reshape", "relax.broadcast_to"):
        return relax.Call(call.op, [args[0], relax.ShapeExpr(list(shape))], call.attrs,
                          call.ty_args)
    if name == "relax.split":
        pieces = [local_shape(shape, h, tp) if h is not None else shape
                  for shape, h in zip(field_shapes(var), hi)]
        axis = int(call.attrs.axis) % len(pieces[0])
        bounds, acc = [], 0
        for piece in pieces[:-1]:
            acc += piece[axis]
            bounds.append(acc)
        return relax.op.split(args[0], bounds, axis=int(call.attrs.axis))
    return relax.Call(call.op, args, call.attrs, call.ty_args)


def _check_local(var, new, layouts, tp):
    """The rewritten binding has the shape the layout promises (the rules and the op's own
    shape inference must agree; a disagreement is a bug here, not in the user's model)."""
    hi = layouts.get(var)
    if isinstance(hi, tuple) or not isinstance(var.ty, relax.TensorType):
        return
    expected = local_shape(static_shape(var), None if hi == PARTIAL else hi, tp)
    got = static_shape(new)
    if got is not None and tuple(got) != tuple(expected):
        raise AssertionError(f"tensor parallel rewrite of {var.name}: local shape {got}, "
                             f"expected {expected}")
