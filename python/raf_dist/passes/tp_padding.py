"""A vocabulary that T tensor-parallel ranks do not divide, padded to a multiple of T.

GPT-2's 50257 rows at T = 2 would leave the token table and the tied head whole on every
rank. Megatron pads the vocabulary (``--make-vocab-size-divisible-by``,
``_vocab_size_with_padding``) and trains the padded rows as classes nobody uses, which
changes the softmax; vLLM pads and cuts the logits back. Here the padding is invisible (the
numbers of one process, ``state_dict()`` in true shapes):

- the vocabulary's parameters (the table, an untied head, the head's bias) get zero rows up to
  ``ceil(V / T) * T``; the lookup reads rows of ids < V only, so it never sees them;
- when the padded classes reach the forward's output (the head; vocabulary-parallel
  cross-entropy), ``mask_padded_classes`` sets their logits to ``masked_logit``, a finite
  value far below any logit: exp(masked - max) is 0 in the loss's sum of exponentials (and
  the loss's one-hot product stays finite, which -inf would not), no target is padded, and
  ``where`` passes no gradient back, so the padded rows' gradients are 0 and the rows stay 0
  under every optimizer (the real rows see exactly one process's gradients);
- ``predict`` cuts the output back to V classes, ``TensorParallelPlan.assemble`` cuts the rows
  of ``state_dict()`` and checkpoints, ``local_shard`` pads them again on load.

``vocabulary_layouts`` finds the values that carry the vocabulary dimension (``propagate`` from
the padded parameters with one "rank" per vocabulary row, T = V: the rank digit is then the
whole dimension, which no other dimension can be mistaken for, as at T = 1) and
``pad_forward`` gives them the padded size: the same model with ``ceil(V / T) * T`` classes, on
which the tensor-parallel search runs as on any vocabulary that divides.
``vocabulary_problem`` says why a candidate cannot be padded this way: its padded values would
meet real ones (a matmul contracting the vocabulary, an inner layer whose padded activations
feed the next, a split along it).
"""
import dataclasses

import numpy as np
from tvm import relax

from .gradient_markers import SubstituteVars
from .tp_layout import propagate, static_shape, strides
from .tp_ops import tp_rank


@dataclasses.dataclass(frozen=True)
class Padding:
    """A parameter's vocabulary dimension ``dim``: ``size`` true rows, ``padded`` held."""

    dim: int
    size: int
    padded: int


def padded_size(size: int, tp: int) -> int:
    """The smallest multiple of ``tp`` not below ``size``: each rank holds ceil(size / tp)."""
    return -(-int(size) // tp) * tp


def masked_logit(dtype: str) -> float:
    """The value of a padded class's logit: half the dtype's largest magnitude (float32's for
    bfloat16, whose range it shares), so that logit - max stays finite."""
    return -0.5 * float(np.finfo("float16" if dtype == "float16" else "float32").max)


def vocabulary_layouts(func, padding, split_output):
    """{var: (hi, true size, padded size)} of every value of ``func`` that carries a
    padded vocabulary dimension; ``padding``: {param var: Padding}. Parameters padded to the
    same size are followed together (one vocabulary), different sizes one at a time."""
    out = {}
    for size in sorted({p.size for p in padding.values()}):
        group = {v: (p.dim, p.size) for v, p in padding.items() if p.size == size}
        padded = next(p.padded for p in padding.values() if p.size == size)
        result = propagate(func, size, group, set(func.params), set(), split_output)
        for var, hi in result.layouts.items():
            if isinstance(hi, tuple):  # a split along another axis: its fields carry it
                continue
            if var in out:
                raise ValueError(f"{var.name} carries two padded vocabularies")
            out[var] = (hi, size, padded)
    return out


def vocabulary_problem(func, placements, result):
    """Why the split found at T = V from a vocabulary candidate cannot be padded (None: it
    can). ``placements``: {param var: (dim, size)}; ``result``: their Propagation."""
    sizes = {size for _, size in placements.values()}
    if len(sizes) != 1 or any(static_shape(p)[d] != s for p, (d, s) in placements.items()):
        return "the vocabulary dimension is cut in segments"
    size = sizes.pop()
    if size < 2:
        return "a vocabulary of one row"
    if result.partials - result.vocab_takes:
        return "a matmul contracts the vocabulary dimension (padded values would reach real ones)"
    for var, hi in result.layouts.items():
        if not isinstance(hi, tuple) and _vocab_dim(static_shape(var), hi, size) is None:
            return f"{var.name} reshapes the vocabulary dimension"
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.split"
                    and value.args[0] in result.layouts):
                shape = static_shape(value.args[0])
                axis = int(value.attrs.axis) % len(shape)
                if axis == _vocab_dim(shape, result.layouts[value.args[0]], size):
                    return f"{binding.var.name} splits the vocabulary dimension"
    return None


def _vocab_dim(shape, hi, size):
    """The dimension of ``shape`` that holds the vocabulary (``size`` per segment) whose flat
    stride above it is ``hi``, or None."""
    for j, (d, st) in enumerate(zip(shape, strides(shape))):
        if st * size == hi and d % size == 0:
            return j
    return None


def padded_shape(shape, hi, size, padded):
    j = _vocab_dim(shape, hi, size)
    return tuple(d // size * padded if i == j else d for i, d in enumerate(shape))


def pad_forward(func, padding, split_output=False):
    """``func`` with the parameters of ``padding`` ({param var: Padding}) padded and every
    value carrying their vocabulary with them (only shapes change; no op is added)."""
    layouts = vocabulary_layouts(func, padding, split_output)
    var_map, new_params = {}, []
    for p in func.params:
        if p in layouts:
            shape = padded_shape(static_shape(p), *layouts[p])
            var_map[p] = relax.Var(p.name, relax.TensorType(shape, p.ty.dtype))
        new_params.append(var_map.get(p, p))
    attrs = dict(func.attrs) if func.attrs is not None else {}
    name = str(attrs.pop("global_symbol", "forward"))
    bb = relax.BlockBuilder()
    with bb.function(name, new_params, attrs=attrs, pure=True):
        for block in func.body.blocks:
            if isinstance(block, relax.DataflowBlock):
                with bb.dataflow():
                    for b in block.bindings:
                        _pad_binding(bb, b, layouts, var_map,
                                     output=not isinstance(b.var, relax.DataflowVar))
            else:
                for b in block.bindings:
                    _pad_binding(bb, b, layouts, var_map)
        bb.emit_func_output(SubstituteVars(var_map).visit_expr(func.body.body))
    return bb.get()[name]


def _pad_binding(bb, binding, layouts, var_map, output=False):
    var, value = binding.var, binding.value
    expected = static_shape(var)
    if var in layouts:
        expected = padded_shape(expected, *layouts[var])
    if var in layouts and isinstance(value, relax.Call) and getattr(value.op, "name", "") in (
            "relax.reshape", "relax.broadcast_to"):  # the target shape is the padded one
        data = SubstituteVars(var_map).visit_expr(value.args[0])
        new = relax.Call(value.op, [data, relax.ShapeExpr(list(expected))], value.attrs,
                         value.ty_args)
    else:
        new = SubstituteVars(var_map).visit_expr(value)
    emitted = bb.emit_output(new, name_hint=var.name) if output else bb.emit(
        new, name_hint=var.name)
    got = static_shape(emitted)
    if expected is not None and got is not None and tuple(got) != tuple(expected):
        raise AssertionError(f"vocabulary padding of {var.name}: shape {got}, expected "
                             f"{expected}")
    var_map[var] = emitted


def mask_padded_classes(bb, logits, classes):
    """``logits``: this rank's [..., C/T] slice of [..., C] classes, C >= ``classes``; the
    slice with the classes from ``classes`` on (the padding) set to ``masked_logit``."""
    op = relax.op
    local = static_shape(logits)[-1]
    column = bb.emit(op.arange(0, local, 1, "int64"))
    start = bb.emit(op.multiply(tp_rank(column), relax.const(local, "int64")))
    keep = bb.emit(op.less(op.add(column, start), relax.const(classes, "int64")))
    dtype = str(logits.ty.dtype)
    return op.where(keep, logits, relax.const(masked_logit(dtype), dtype))
