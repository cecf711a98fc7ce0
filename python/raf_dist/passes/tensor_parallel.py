"""Tensor parallelism as a rewrite of the forward graph, before autodiff (DESIGN.md 3b).

``plan_tensor_parallel(func, tp, trained, plan=None)`` finds which parameters to split:
every matmul whose weight is a parameter is a column candidate (its output features split);
candidates reading the same activation (q/k/v, gate/up) are tried together, each alone
otherwise. From the split weights, ``tp_layout.propagate`` follows the split through the
graph: elementwise ops, reshapes and transposes (attention heads), the column layer's bias
(split on request), until a matmul contracts the split dimension; its weight is split along
its input features on request (row parallel) and its partial result is summed by g. Whatever
the propagation cannot keep split (a norm over the split dimension, a split value leaving the
region, dimensions that do not divide by T, ...) makes the candidate fail and stay
replicated, with the reason kept for ``explain``. A vocabulary that T does not divide (the
token table, an untied head, their bias) is padded first to a multiple of T (tp_padding.py:
zero rows, their logits masked, invisible outside the ranks). An explicit plan (torchtitan
style, ``{"blocks.*.qkv": "colwise", "blocks.*.proj": "rowwise", "head": "replicate"}``, patterns
over module or parameter names) replaces the search and must come out exactly as written.

``shard_forward(func, tp, placements)`` rewrites the function: split parameters take their
local shapes, shapes in reshape / broadcast_to / split become the local ones, f (tp_copy)
wraps each replicated value a split region reads when a gradient flows through it, g
(tp_reduce) follows each row-parallel matmul, and the padded classes of a padded vocabulary
are masked where the logits leave the forward. Only tensor shapes change; the function stays
SPMD (which slice a rank holds is decided when the Trainer loads parameters).
"""
import dataclasses
import fnmatch
import logging

import numpy as np
from tvm import relax

from .gradient_markers import substitute
from .tp_layout import (PARTIAL, Request, Resegment, Unsplittable, field_shapes,
                        local_shape, propagate, static_shape)
from .tp_ops import tp_copy, tp_rank, tp_reduce
from .tp_padding import (Padding, mask_padded_classes, pad_forward, padded_size,
                         vocabulary_problem)

PLAN_VALUES = ("colwise", "rowwise", "replicate")
_LOG = logging.getLogger("raf_dist")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Parameter split along ``dim`` into ``T`` parts within each of ``segments`` segments."""

    dim: int
    segments: int
    role: str  # "colwise" (output features), "rowwise" (input features), "bias", "split"


@dataclasses.dataclass
class TensorParallelPlan:
    tp: int
    placements: dict  # param name -> Placement
    replicated: dict  # param name -> why it stays whole
    shapes: dict  # param name -> full shape
    forward_reduces: list  # numel of each g in the forward
    backward_reduces: list  # numel of each f whose input needs a gradient
    # the output (logits) stays split along its classes: vocabulary-parallel cross-entropy,
    # whose allreduces (max, sum of exponentials, target logit: one value per row) these are
    output_split: bool = False
    loss_reduces: list = dataclasses.field(default_factory=list)
    # a vocabulary T does not divide, padded to a multiple of T (tp_padding.py):
    # {param name: Padding}; the classes of the output (those of the full model: predict's)
    padding: dict = dataclasses.field(default_factory=dict)
    output_classes: int = 0

    def padded_shape(self, name):
        """The shape the tp ranks hold ``name`` in, together: its full shape, padded."""
        shape, pad = list(self.shapes[name]), self.padding.get(name)
        if pad is not None:
            shape[pad.dim] = pad.padded
        return tuple(shape)

    def local_shard(self, name, array, rank):
        """This tp rank's piece of parameter ``name`` (the whole array when replicated; a
        padded one's padding is zeros)."""
        p = self.placements.get(name)
        if p is None:
            return array
        pad = self.padding.get(name)
        if pad is not None:
            widths = [(0, 0)] * array.ndim
            widths[pad.dim] = (0, pad.padded - array.shape[pad.dim])
            array = np.pad(array, widths)
        shape = array.shape
        seg = array.reshape(shape[:p.dim] + (p.segments, self.tp,
                                              shape[p.dim] // p.segments // self.tp)
                            + shape[p.dim + 1:])
        piece = seg.take(rank, axis=p.dim + 1)
        return piece.reshape(shape[:p.dim] + (shape[p.dim] // self.tp,) + shape[p.dim + 1:])

    def local_shape(self, name, shape):
        """The shape of this tp rank's piece of parameter ``name`` of ``shape`` (what
        local_shard returns, without computing it)."""
        shape = list(shape)
        p = self.placements.get(name)
        if p is None:
            return tuple(shape)
        pad = self.padding.get(name)
        if pad is not None:
            shape[pad.dim] = pad.padded
        shape[p.dim] //= self.tp
        return tuple(shape)

    def assemble(self, name, pieces):
        """The full parameter from every tp rank's piece, in tp-rank order."""
        p = self.placements.get(name)
        if p is None:
            return pieces[0]
        shape = pieces[0].shape
        split = [q.reshape(shape[:p.dim] + (p.segments, 1, shape[p.dim] // p.segments)
                           + shape[p.dim + 1:]) for q in pieces]
        full = np.concatenate(split, axis=p.dim + 1).reshape(self.padded_shape(name))
        pad = self.padding.get(name)
        if pad is not None:  # the padded rows are no part of the model
            full = full[(slice(None),) * pad.dim + (slice(0, pad.size),)]
        return full

    def explain(self, itemsize=4):
        """The plan as text: each parameter's placement (or why it is replicated) and the
        collectives per step with their bytes."""
        lines = [f"tensor parallel plan, T = {self.tp}"]
        width = max((len(n) for n in self.shapes), default=10)
        for name, shape in self.shapes.items():
            p = self.placements.get(name)
            what = (f"{p.role:8s} split dim {p.dim}" + (f" ({p.segments} segments)"
                                                        if p.segments > 1 else "")
                    if p else f"replicated: {self.replicated.get(name, '')}")
            pad = self.padding.get(name)
            if pad is not None:
                extra = pad.padded - pad.size
                what += f", padded to {pad.padded} ({extra} zero row{'s' * (extra > 1)})"
            lines.append(f"  {name:{width}s} {str(list(shape)):16s} {what}")
        bus = 2 * (self.tp - 1) / self.tp * itemsize
        for size, padded in sorted({(p.size, p.padded) for p in self.padding.values()}):
            masked = self.output_split and self.output_classes == size
            lines.append(f"  the vocabulary of {size} is padded to {padded}, a multiple of "
                         f"T = {self.tp} ({padded // self.tp} rows per rank; the added rows "
                         "are zeros" + ("; their logits are masked out of the loss and "
                                        "predict" if masked else "")
                         + "); state_dict() and checkpoints keep the true shapes")
        if self.output_split:
            lines.append("  the output stays split along its classes: vocabulary-parallel "
                         "cross-entropy")
        for kind, sizes in (("forward", self.forward_reduces),
                            ("backward", self.backward_reduces), ("loss", self.loss_reduces)):
            if kind == "loss" and not sizes:
                continue
            lines.append(f"  {kind}: {len(sizes)} allreduce(s) over tp, "
                         f"{sum(sizes) * itemsize} bytes, {sum(sizes) * bus:.0f} bus bytes")
        return "\n".join(lines)


def plan_tensor_parallel(func, tp, param_names, trained, plan=None, split_output=False,
                         keep_whole=()):
    """Find the placements (see the module docstring). ``param_names``: names of ``func``'s
    parameter arguments (the last ``len(param_names)`` arguments before any buffers, in
    order: ``vars_by_name`` below); ``trained``: names of those that get gradients;
    ``split_output``: the loss takes logits split along their classes (cross-entropy);
    ``keep_whole``: names every tp rank holds whole (embedding tables sharded over the dp
    ranks instead: embedding_parallel), which a ``plan`` must not split.
    A vocabulary T does not divide is padded (tp_padding.py) when the search then splits it;
    a padded parameter the search keeps whole is planned again unpadded, with its group."""
    keep_whole = frozenset(keep_whole)
    for name in sorted(keep_whole):
        value = _plan_value(plan, name) if plan is not None else None
        if value in ("colwise", "rowwise"):
            raise ValueError(f"tensor parallel plan: {name!r} is planned {value!r}, but it is "
                             "an embedding table embedding_parallel shards over the "
                             "data-parallel ranks; plan it \"replicate\" or leave it out of "
                             "the plan")
    by_name = vars_by_name(func, param_names)
    groups, unpaddable = _vocabulary_padding(func, tp, by_name, trained, split_output,
                                             keep_whole)
    while True:
        padding = {n: p for group in groups for n, p in group.items()}
        padded = pad_forward(func, {by_name[n]: p for n, p in padding.items()},
                             split_output) if padding else func
        out = _search(padded, tp, param_names, trained, plan, split_output, keep_whole)
        whole = {n for n, p in padding.items()
                 if n not in out.placements or out.placements[n].dim != p.dim}
        if not whole:
            break
        groups = [g for g in groups if not whole & set(g)]
    out.shapes = {n: static_shape(by_name[n]) for n in param_names}
    out.padding = padding
    if plan is None:  # why it would stay whole even if T divided it, rather than that T does not
        out.replicated.update({n: why for n, why in unpaddable.items() if n in out.replicated})
    if out.output_split:
        out.output_classes = static_shape(_first_output(func))[-1]
    return out


def _first_output(func):
    """The forward's output (the first field when it returns (output, *buffers))."""
    out = func.body.body
    return out.fields[0] if isinstance(out, relax.Tuple) else out


def _vocabulary_padding(func, tp, by_name, trained, split_output, keep_whole=frozenset()):
    """([{param name: Padding}], {param name: why not}): one group per vocabulary T does not
    divide that padding can split (tp_padding.py): an embedding table the search would split
    (with the head tied to it and its bias), a head whose classes leave the forward split
    (vocabulary-parallel cross-entropy) with its bias; each found by propagating its split at
    T = V. Why not: the split fails even then."""
    names = {v: n for n, v in by_name.items()}
    params = set(by_name.values())
    needs_grad = _needs_grad(func, [by_name[n] for n in trained if n in by_name])
    candidates, _ = _column_candidates(func, params)
    groups, seen, unpaddable = [], set(), {}
    for param, dim, root in candidates:
        size = static_shape(param)[dim]
        if param in seen or size % tp == 0 or names[param] in keep_whole:
            seen.add(param)
            continue
        seen.add(param)
        placements, why = _try(func, size, {}, [(param, dim)], by_name, needs_grad, {},
                               split_output)
        if placements is None:
            unpaddable[names[param]] = why
            continue
        if any(names[p] in g for g in groups for p in placements):
            continue
        result = propagate(func, size, placements, params, needs_grad, split_output)
        # an inner layer's padded activations would feed the next layer's real outputs: only
        # a lookup (ids < V) and masked output classes keep the padding apart
        if not (root.same_as(param) or result.output_split):
            continue
        if vocabulary_problem(func, placements, result) is None:
            groups.append({names[p]: Padding(d, s, padded_size(s, tp))
                           for p, (d, s) in placements.items()})
    if len(groups) > 1:  # vocabularies of different sizes must not meet
        try:
            pad_forward(func, {by_name[n]: p for g in groups for n, p in g.items()},
                        split_output)
        except (ValueError, Unsplittable, Request) as err:
            _LOG.warning("tensor parallel: vocabularies %s not padded: %s",
                         sorted(n for g in groups for n in g), err)
            return [], unpaddable
    return groups, unpaddable


def _search(func, tp, param_names, trained, plan, split_output, keep_whole=frozenset()):
    """plan_tensor_parallel on ``func`` as it is (its shapes padded already)."""
    by_name = vars_by_name(func, param_names)
    names = {v: n for n, v in by_name.items()}
    needs_grad = _needs_grad(func, [by_name[n] for n in trained if n in by_name])
    candidates, notes = _column_candidates(func, set(by_name.values()))
    candidates = [c for c in candidates if names[c[0]] not in keep_whole]
    accepted, reasons = {}, {}
    if plan is not None:
        groups, forced = _explicit_groups(plan, candidates, names, param_names)
    else:
        groups, forced = _candidate_groups(candidates), {}
    forced.update({by_name[n]: "held whole by every tp rank (sharded over the data-parallel "
                               "ranks: embedding_parallel)" for n in keep_whole if n in by_name})
    for group in groups:
        attempts = [group] + ([[c] for c in group] if len(group) > 1 and plan is None else [])
        for attempt in attempts:
            placements, why = _try(func, tp, accepted, attempt, by_name, needs_grad, forced,
                                   split_output)
            if placements is not None:
                accepted = placements
                break
        else:
            for param, _ in group:
                reasons[names[param]] = why
            if plan is not None:
                raise ValueError(f"tensor parallel plan: cannot split "
                                 f"{', '.join(names[p] for p, _ in group)} as planned: {why}. "
                                 "Plan it \"replicate\" (or leave it out of the plan), or use a "
                                 "tensor_parallel_size that divides its dimensions")
    result = propagate(func, tp, accepted, set(by_name.values()), needs_grad, split_output)
    roles = _roles(func, accepted, result)
    numel = lambda v: int(np.prod(static_shape(v), dtype=np.int64))  # noqa: E731
    out = TensorParallelPlan(
        tp, {names[p]: Placement(d, static_shape(p)[d] // s, roles.get(p, "split"))
             for p, (d, s) in accepted.items()}, {}, {},
        [numel(v) for v in result.partials], [numel(v) for v in set(result.copies.values())],
        result.output_split)
    if result.output_split:  # per row: the max, the sum of exponentials, the target logit
        out_shape = static_shape(func.body.body.fields[0] if isinstance(
            func.body.body, relax.Tuple) else func.body.body)
        out.loss_reduces = [int(np.prod(out_shape[:-1], dtype=np.int64))] * 3
    for name in param_names:
        var = by_name[name]
        out.shapes[name] = static_shape(var)
        if var not in accepted:
            out.replicated[name] = reasons.get(name, forced.get(var) or notes.get(var) or (
                "not in the plan" if plan is not None else _default_reason(var, candidates)))
    if plan is not None:
        _check_explicit(plan, out, param_names)
    return out


def vars_by_name(func, param_names):
    """{parameter name: the forward's argument}: the parameters are its arguments from the
    first one's on, named ``p_<name>`` (from_pytorch) or ``<name>`` (from_relax_nn)."""
    params = [p for p in func.params]
    first = (_arg_name(param_names[0]), param_names[0]) if param_names else ()
    start = next((i for i, p in enumerate(params) if p.name in first),
                 None) if param_names else 0
    if start is None:
        raise ValueError("the forward's arguments do not include the model's parameters "
                         f"(looked for {param_names[0]!r})")
    return dict(zip(param_names, params[start:start + len(param_names)]))


def _arg_name(name):
    return "p_" + name.replace(".", "_")


def _default_reason(var, candidates):
    if any(p.same_as(var) for p, _, _ in candidates):
        return "its matmul's output cannot stay split"
    return "not a matmul weight next to a split layer"


def _try(func, tp, accepted, group, by_name, needs_grad, forced, split_output):
    """Placements with ``group`` split as columns, growing with the propagation's requests;
    (None, why) when the graph cannot stay split."""
    seeds, requests = {}, {}
    for param, dim in group:
        if param in accepted:
            return None, "already split"
        seeds[param] = (dim, static_shape(param)[dim])
    for _ in range(64):
        placements = {**accepted, **seeds, **requests}
        try:
            propagate(func, tp, placements, set(by_name.values()), needs_grad, split_output)
            return placements, None
        except Request as request:
            name = next(n for n, v in by_name.items() if v.same_as(request.param))
            if request.param in placements or request.param in forced:
                return None, (f"{name} would need a second split" if request.param in placements
                              else f"{name} is to stay replicated by the plan")
            requests[request.param] = (request.dim, request.size)
        except Resegment as change:  # start again with each seed cut in segments
            for param, (dim, size) in seeds.items():
                full = static_shape(param)[dim]
                if size != full or full % change.segments:
                    return None, "cannot cut the split dimension into segments"
                seeds[param] = (dim, full // change.segments)
            requests = {}
        except Unsplittable as stop:
            return None, str(stop)
    return None, "the plan did not settle"


def _needs_grad(func, trained_vars):
    need = set(trained_vars)
    for block in func.body.blocks:
        for binding in block.bindings:
            ty = binding.var.ty
            floating = not isinstance(ty, relax.TensorType) or "float" in str(ty.dtype)
            if floating and any(v in need for v in relax.analysis.free_vars(binding.value)):
                need.add(binding.var)
    return need


def _column_candidates(func, params):
    """[(param var, dim of its output features, root var of the activation it multiplies)]
    for each matmul whose right operand is a 2-D parameter, possibly transposed, and
    (param var, 0, itself) for each embedding table (split along the vocabulary)."""
    bound, out, embeddings = {}, [], []
    for block in func.body.blocks:
        for binding in block.bindings:
            bound[binding.var] = binding.value
            value = binding.value
            name = getattr(value.op, "name", "") if isinstance(value, relax.Call) else ""
            if (name == "relax.take" and value.args[0] in params
                    and len(static_shape(value.args[0])) == 2 and value.attrs.axis is not None
                    and int(value.attrs.axis) == 0):  # an embedding: vocabulary parallel
                embeddings.append((value.args[0], static_shape(value.args[0])[0],
                                   int(np.prod(static_shape(value.args[1]), dtype=np.int64))))
                continue
            if name != "relax.matmul":
                continue
            a, b = value.args
            if b in params and len(static_shape(b)) == 2:
                param, dim = b, 1
            else:
                v = bound.get(b)
                if not (isinstance(v, relax.Call) and getattr(v.op, "name", "") ==
                        "relax.permute_dims" and v.args[0] in params
                        and len(static_shape(v.args[0])) == 2):
                    continue
                param, dim = v.args[0], 0
            out.append((param, dim, _root(a, bound)))
    # a table is split when it is also an output head (tied) or larger than the ids it looks
    # up per step: splitting costs an allreduce of the looked-up rows and saves (V - V/T)
    # rows of parameter, gradient and optimizer state (Megatron splits the word embedding,
    # not the position table)
    heads = {p for p, _, _ in out}
    split = [(p, 0, p) for p, rows, ids in embeddings if p in heads or rows > ids]
    notes = {p: (f"an embedding of {rows} rows looking up {ids} ids per step: splitting it "
                 "would cost an allreduce of the rows looked up for little memory")
             for p, rows, ids in embeddings if not (p in heads or rows > ids)}
    # a tied table is tried as an embedding first (_candidate_groups)
    return split + out, notes


def _root(var, bound):
    while True:
        v = bound.get(var)
        if isinstance(v, relax.Call) and getattr(v.op, "name", "") in ("relax.reshape",
                                                                       "relax.astype"):
            var = v.args[0]
        elif isinstance(v, relax.Var):
            var = v
        else:
            return var


def _candidate_groups(candidates):
    groups, seen = {}, set()
    for param, dim, root in candidates:
        if param in seen:
            continue
        seen.add(param)
        groups.setdefault(root, []).append((param, dim))
    return list(groups.values())


def _matches(pattern, name):
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def _explicit_groups(plan, candidates, names, param_names):
    if not isinstance(plan, dict):
        raise TypeError(f"tensor parallel plan must be a dict {{name pattern: 'colwise' | "
                        f"'rowwise' | 'replicate'}}, e.g. {{\"blocks.*.fc1\": \"colwise\"}}; got "
                        f"{type(plan).__name__}")
    for key, value in plan.items():
        if value not in PLAN_VALUES:
            raise ValueError(f"tensor parallel plan: {key!r}: {value!r} is not one of "
                             f"{PLAN_VALUES}")
        if not any(_matches(key, n) for n in param_names):
            raise ValueError(f"tensor parallel plan: {key!r} matches no parameter (they are: "
                             f"{', '.join(param_names[:8])}{', ...' if len(param_names) > 8 else ''})")
    groups, forced = [], {}
    for param, dim, root in candidates:
        value = _plan_value(plan, names[param])
        # torchtitan's names: an embedding table split along the vocabulary is "rowwise"
        wanted = "rowwise" if root.same_as(param) else "colwise"
        if value == wanted and all(not p.same_as(param) for g in groups for p, _ in g):
            groups.append([(param, dim)])
    for var, name in names.items():
        if _plan_value(plan, name) == "replicate":
            forced[var] = "replicated by the plan"
    return groups, forced


def _plan_value(plan, name):
    hits = [v for k, v in plan.items() if _matches(k, name)]
    return hits[-1] if hits else None


def _check_explicit(plan, result, param_names):
    for name in param_names:
        value = _plan_value(plan, name)
        p = result.placements.get(name)
        weight = len(result.shapes[name]) > 1  # a row layer's bias stays whole (after g)
        if value == "rowwise" and weight and (p is None or p.role not in (
                "rowwise", "vocab", "vocab+colwise")):
            raise ValueError(f"tensor parallel plan: {name} is planned rowwise but no "
                             f"column-parallel layer feeds it ({result.replicated.get(name)})")
        if value == "colwise" and weight and (p is None or p.role not in (
                "colwise", "vocab+colwise")):
            raise ValueError(f"tensor parallel plan: {name} is planned colwise but stays "
                             f"{p.role if p else 'replicated'}")


def _roles(func, placements, result):
    """colwise / rowwise / bias for the report, from how each split parameter is used."""
    roles, bound = {}, {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            bound[binding.var] = value
            if binding.var in result.vocab_takes:
                roles[value.args[0]] = "vocab"
            if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") ==
                    "relax.matmul"):
                continue
            weight = _weight_param(value.args[1], bound)
            if weight is not None and weight in placements:
                role = "rowwise" if binding.var in result.partials else "colwise"
                roles[weight] = f"vocab+{role}" if roles.get(weight) == "vocab" else role
    for param in placements:
        roles.setdefault(param, "bias" if len(static_shape(param)) == 1 else "split")
    return roles


def _weight_param(expr, bound):
    """The parameter a matmul's right operand is (possibly transposed), else None."""
    value = bound.get(expr)
    if (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.permute_dims"
            and isinstance(value.args[0], relax.Var)):
        return value.args[0]
    return expr if isinstance(expr, relax.Var) and expr not in bound else None


# ---- the rewrite ------------------------------------------------------------------------
def shard_forward(func, tp, param_names, trained, plan):
    """``func`` with the placements of ``plan`` (a TensorParallelPlan) applied."""
    classes = None  # the true classes of a padded output, whose padding is masked
    if plan.padding:
        by_name = vars_by_name(func, param_names)
        true_classes = static_shape(_first_output(func))[-1]
        func = pad_forward(func, {by_name[n]: p for n, p in plan.padding.items()},
                           plan.output_split)
        if plan.output_split and static_shape(_first_output(func))[-1] != true_classes:
            classes = true_classes
    masked = _first_output(func) if classes is not None else None  # the binding to mask
    by_name = vars_by_name(func, param_names)
    placements = {}
    for name, p in plan.placements.items():
        var = by_name[name]
        placements[var] = (p.dim, static_shape(var)[p.dim] // p.segments)
    needs_grad = _needs_grad(func, [by_name[n] for n in trained if n in by_name])
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
