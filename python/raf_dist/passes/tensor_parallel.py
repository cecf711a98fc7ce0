"""Tensor parallelism as a rewrite of the forward graph, before autodiff (DESIGN.md 3b); this
module searches which parameters to split.

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

The plan found is a ``TensorParallelPlan`` (tp_plan.py); ``shard_forward`` (tp_shard.py)
rewrites the forward to it. The helpers both read the forward with (``vars_by_name``,
``values_needing_grad``, ``first_output``) are here.
"""
import fnmatch
import logging

import numpy as np
from tvm import relax

from .tp_layout import Request, Resegment, Unsplittable, propagate, shape_cache, static_shape
from .tp_padding import Padding, pad_forward, padded_size, vocabulary_problem
from .tp_plan import Placement, TensorParallelPlan

PLAN_VALUES = ("colwise", "rowwise", "replicate")
_LOG = logging.getLogger("raf_dist")


def plan_tensor_parallel(func, tp, param_names, trained, plan=None, split_output=False,
                         keep_whole=()):
    """``_find_plan`` with the function's shapes read once (tp_layout.shape_cache)."""
    with shape_cache():
        return _find_plan(func, tp, param_names, trained, plan, split_output, keep_whole)


def _find_plan(func, tp, param_names, trained, plan=None, split_output=False,
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
        out.output_classes = static_shape(first_output(func))[-1]
    return out


def first_output(func):
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
    needs_grad = values_needing_grad(func, [by_name[n] for n in trained if n in by_name])
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
    needs_grad = values_needing_grad(func, [by_name[n] for n in trained if n in by_name])
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


def values_needing_grad(func, trained_vars):
    """The trained parameters and every value of ``func`` computed from them that is not an
    integer tensor: what a gradient flows through."""
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
