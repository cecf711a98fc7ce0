"""Operators TVM 0.27's ExportedProgram importer lacks or types wrongly, as
``custom_convert_map`` entries (``converters()``), and the importer's unsupported-operator
check made to name the aten operator and where it occurs (``install_unsupported_op_check``).

- ``_embedding_bag`` (nn.EmbeddingBag, modes sum and mean, offsets, per-sample weights,
  padding_idx): rows gathered with ``take``, then summed per bag by a matmul with a 0/1
  membership matrix built from the offsets, all ops with gradients and schedules.
- ``cumsum``: the importer keeps the input dtype, so the cumsum of a bool tensor is typed bool
  (PyTorch gives int64) and LLVM code generation crashes on the bool accumulator; integer and
  bool inputs accumulate in int64 as in PyTorch.
- ``div`` with a rounding mode: the importer types a Python scalar divisor int32 whatever the
  tensor's dtype (an int64 position // 2 fails to import), and true division of integer
  tensors stays integer where PyTorch gives float32.
- ``clamp`` of an integer tensor with one bound: the importer emits clip(x, lo, inf), whose
  infinite bound cannot be lowered for integers; maximum / minimum with the given bounds.
- ``cat``: PyTorch skips empty 1-D inputs (Hugging Face's DynamicCache starts from one);
  Relax's concat rejects the rank mismatch.
- ``index.Tensor`` with several index tensors and a sliced dimension (``z[:, rows, cols]``):
  the importer takes an outer product where PyTorch picks one element per position
  (``frontend/indexing.py``).

- ``add`` / ``sub`` with ``alpha`` (``x.add_(y, alpha=a)``, ``torch.sub(x, y, alpha=a)``, and
  ``rsub``, which decomposes to them): the importer drops ``alpha``; the second operand is
  scaled by it here.
- ``elu`` with ``scale`` / ``input_scale`` (``F.selu`` decomposes to ``elu(x, alpha, scale)``):
  the importer drops both; computed as PyTorch's ``scale * (x > 0 ? x : alpha * (exp(input_scale
  * x) - 1))``.

- ``_scaled_dot_product_flash_attention_for_cpu`` (what ``F.scaled_dot_product_attention``
  exports as on the CPU, transformers' sdpa attention included): raf_dist's attention op
  (ir/attention.py: blockwise, never T x T), with its causal flag, scale, additive mask
  (a boolean one PyTorch has already made additive) and grouped key/value heads. PyTorch
  exports attention with dropout_p > 0 through its math path, which stays as it is.

A converter that fails (TVM's or one of these) raises ``ConversionError`` naming the aten
operator, its graph node and module path (``install_unsupported_op_check``). Operators that
draw random numbers (PyTorch's tag ``nondeterministic_seeded``: ``bernoulli``, ``randn``,
``rand_like``, ``normal``, ``exponential``, ...) are refused by the same check unless their
converter is marked ``seeded`` (dropout, captured as the Trainer's seeded masks): TVM's
importer converts them to a fixed tensor (``bernoulli.p`` returns its input, ``randn`` a
constant drawn once at import, ``exponential`` zeros), which would change training silently.
"""
from tvm import relax

from . import indexing

op = relax.op


class UnsupportedOperatorError(ValueError):
    """An aten operator the Relax importer cannot convert (raised by from_pytorch)."""


def _arg(node, index, name, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_float(dtype) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def _attention(node, importer) -> relax.Var:
    """(output, log-sum-exp) of the attention op (module docstring)."""
    from ..ir.attention import attention

    dropout_p = float(_arg(node, 3, "dropout_p", 0.0))
    if dropout_p:  # PyTorch's CPU kernel refuses it too: export never gives one
        raise ValueError(f"attention with dropout_p={dropout_p} reached the flash op")
    q, k, v = (importer.env[a] for a in node.args[:3])
    mask = node.kwargs.get("attn_mask")
    mask = importer.env[mask] if mask is not None else None
    return importer.block_builder.emit(attention(
        q, k, v, mask, causal=bool(_arg(node, 4, "is_causal", False)),
        scale=node.kwargs.get("scale")))


# PyTorch tags the op nondeterministic_seeded for its dropout; with dropout_p = 0 (the only
# value it is exported with: the converter checks) it draws nothing
_attention.seeded = True  # type: ignore[attr-defined]


def _cumsum(node, importer) -> relax.Var:
    x = importer.env[node.args[0]]
    dim = _arg(node, 1, "dim")
    dtype = node.kwargs.get("dtype")
    if dtype is not None:
        dtype = importer._convert_data_type(str(dtype), importer.env)
    elif not _is_float(x.ty.dtype):
        dtype = "int64"  # torch.cumsum promotes bool and integer inputs to int64
    return importer.block_builder.emit(op.cumsum(x, dim, dtype))


def _div(node, importer) -> relax.Var:
    bb = importer.block_builder
    lhs, rhs = (importer.env[a] if hasattr(a, "op") else a for a in node.args[:2])
    mode = _arg(node, 2, "rounding_mode")
    if not isinstance(lhs, relax.Expr):  # scalar / tensor
        lhs = relax.const(lhs, str(rhs.ty.dtype))
    if not isinstance(rhs, relax.Expr):
        rhs = relax.const(rhs, str(lhs.ty.dtype) if _is_float(lhs.ty.dtype) or isinstance(
            rhs, int) else "float32")
    if mode is None and not _is_float(lhs.ty.dtype) and not _is_float(rhs.ty.dtype):
        lhs, rhs = bb.emit(op.astype(lhs, "float32")), bb.emit(op.astype(rhs, "float32"))
    if str(lhs.ty.dtype) != str(rhs.ty.dtype):  # int tensor / float scalar: float32 as torch
        lhs, rhs = bb.emit(op.astype(lhs, "float32")), bb.emit(op.astype(rhs, "float32"))
    if mode is None:
        return bb.emit(op.divide(lhs, rhs))
    if mode == "floor":
        return bb.emit(op.floor_divide(lhs, rhs))
    if mode == "trunc":
        return bb.emit(op.trunc(op.divide(lhs, rhs)))
    raise ValueError(f"unsupported rounding_mode {mode!r} of torch.div")


def _clamp(node, importer) -> relax.Var:
    x = importer.env[node.args[0]]
    low, high = _arg(node, 1, "min"), _arg(node, 2, "max")
    if _is_float(x.ty.dtype) or not all(b is None or isinstance(b, (int, float))
                                        for b in (low, high)):
        return importer._clamp(node)  # TVM's own is right for floating point
    dtype = str(x.ty.dtype)
    if low is not None:
        x = importer.block_builder.emit(op.maximum(x, relax.const(int(low), dtype)))
    if high is not None:
        x = importer.block_builder.emit(op.minimum(x, relax.const(int(high), dtype)))
    return x


def _embedding_bag(node, importer) -> relax.Var:
    """aten._embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
    per_sample_weights, include_last_offset, padding_idx) -> (output, offset2bag, bag_size,
    max_indices), for 1-D indices with offsets (what nn.EmbeddingBag passes)."""
    bb = importer.block_builder
    env = importer.env
    weight, indices, offsets = (env[node.args[i]] for i in range(3))
    mode = int(_arg(node, 4, "mode", 0))
    per_sample = _arg(node, 6, "per_sample_weights")
    include_last = bool(_arg(node, 7, "include_last_offset", False))
    padding_idx = _arg(node, 8, "padding_idx", -1)
    if mode not in (0, 1):
        raise NotImplementedError("nn.EmbeddingBag(mode='max') is not supported; use 'sum' "
                                  "or 'mean'")
    if _arg(node, 3, "scale_grad_by_freq", False):
        raise NotImplementedError("nn.EmbeddingBag(scale_grad_by_freq=True) is not supported")
    dtype = str(weight.ty.dtype)
    length = int(indices.ty.shape[0])
    bags = int(offsets.ty.shape[0]) - (1 if include_last else 0)
    if include_last:
        offsets = bb.emit(op.strided_slice(offsets, [0], [0], [bags]))
    index_dtype = str(offsets.ty.dtype)
    # bag of position l: how many bag starts are <= l, minus one
    positions = bb.emit(op.arange(0, length, 1, index_dtype))
    started = bb.emit(op.less_equal(op.expand_dims(offsets, 0), op.expand_dims(positions, 1)))
    bag_of = bb.emit(op.subtract(op.sum(op.astype(started, index_dtype), [1]),
                                 relax.const(1, index_dtype)))
    member = op.equal(op.expand_dims(bag_of, 1),
                      op.expand_dims(op.arange(0, bags, 1, index_dtype), 0))  # (L, bags)
    if padding_idx is not None and int(padding_idx) >= 0:  # padding rows are left out
        keep = op.not_equal(indices, relax.const(int(padding_idx), str(indices.ty.dtype)))
        member = op.logical_and(member, op.expand_dims(keep, 1))
    member = bb.emit(op.astype(member, dtype))
    rows = bb.emit(op.take(weight, indices, axis=0))  # (L, D)
    if per_sample is not None:
        rows = bb.emit(op.multiply(rows, op.expand_dims(env[per_sample], 1)))
    out = bb.emit(op.matmul(op.permute_dims(member, [1, 0]), rows))  # (bags, D)
    counts = bb.emit(op.sum(member, [0]))
    if mode == 1:  # mean; an empty bag gives zeros, as PyTorch
        out = bb.emit(op.divide(out, op.expand_dims(
            op.maximum(counts, relax.const(1.0, dtype)), 1)))
    bag_size = bb.emit(op.astype(counts, index_dtype))
    return bb.emit(relax.Tuple([out, bag_of, bag_size, bag_size]))


def _is_empty_vector(tensor) -> bool:
    shape = getattr(tensor.ty, "shape", None)
    return (shape is not None and len(shape) == 1 and hasattr(shape[0], "value")
            and int(shape[0].value) == 0)


def _cat(node, importer) -> relax.Var:
    """torch.cat skips 1-D tensors with no elements whatever the other inputs' rank (a legacy
    rule Hugging Face's DynamicCache relies on: its empty cache is ``torch.tensor([])``, and
    every layer's keys are ``cat([cache, keys], dim=-2)``); Relax's concat requires equal
    ranks. Leave those out as PyTorch does."""
    tensors = [importer.env[t] for t in node.args[0]]
    dim = _arg(node, 1, "dim", 0)
    kept = [t for t in tensors if not _is_empty_vector(t)]
    if not kept:  # nothing but empty tensors: the result is one of them
        return tensors[0]
    if len(kept) == 1:
        return kept[0]
    return importer.block_builder.emit(op.concat(kept, axis=dim))


def _alpha(node, importer) -> relax.Var:
    """``add`` / ``sub`` (Tensor or Scalar) with ``alpha``: ``a op alpha * b``. TVM's converter
    ignores ``alpha``; it is given the scaled operand."""
    import operator

    relax_op, python_op = ((op.add, operator.add) if node.target.__name__.startswith("add")
                           else (op.subtract, operator.sub))
    convert = importer._binary_op(relax_op, python_op)
    alpha = _arg(node, 2, "alpha", 1)  # keyword-only in the Tensor overloads
    other = node.args[1]
    if alpha != 1 and hasattr(other, "op"):  # a graph node: its tensor, scaled in its dtype
        other = importer.env[other]
        other = importer.block_builder.emit(op.multiply(other, relax.const(alpha, str(
            other.ty.dtype))))
    elif alpha != 1:  # a Python number
        other = other * alpha
    return convert(_Node((node.args[0], other)))  # TVM's converter reads exactly two args


def _elu(node, importer) -> relax.Var:
    """aten.elu(x, alpha=1, scale=1, input_scale=1) = scale * (x if x > 0 else
    alpha * (exp(input_scale * x) - 1)); TVM's converter ignores scale and input_scale."""
    alpha, scale = _arg(node, 1, "alpha", 1.0), _arg(node, 2, "scale", 1.0)
    input_scale = _arg(node, 3, "input_scale", 1.0)
    if scale == 1 and input_scale == 1:
        return importer._elu(node)
    if not input_scale > 0:  # the relu form below needs exp(input_scale * x) < 1 for x < 0
        raise ValueError(f"input_scale={input_scale} is not supported (only > 0, as in every "
                         "PyTorch module)")
    x = importer.env[node.args[0]]
    dtype = str(x.ty.dtype)

    def const(value):
        return relax.const(float(value), dtype)

    # the negative branch as TVM writes elu: -alpha * relu(1 - exp(input_scale * x)), whose
    # gradient is defined through relu and exp
    negative = op.multiply(const(-alpha), op.nn.relu(op.subtract(
        const(1.0), op.exp(op.multiply(const(input_scale), x)))))
    return importer.block_builder.emit(op.multiply(const(scale), op.add(op.nn.relu(x), negative)))


def converters() -> dict:
    """The ``custom_convert_map`` entries of this module."""
    from .pipeline_split import CONVERTERS as pipeline_converters

    return {**pipeline_converters, "_embedding_bag.default": _embedding_bag,
            "_scaled_dot_product_flash_attention_for_cpu.default": _attention,
            "_embedding_bag_forward_only.default": _embedding_bag,
            "cat.default": _cat, "concat.default": _cat,
            "cumsum.default": _cumsum, "clamp.default": _clamp,
            "div.Tensor_mode": _div, "div.Scalar_mode": _div,
            "floor_divide.default": lambda node, importer: _div(_FloorNode(node), importer),
            # x[:, rows, cols]: TVM's converter takes an outer product (frontend/indexing.py)
            "index.Tensor": indexing.index_tensor,
            "add.Tensor": _alpha, "add.Scalar": _alpha, "sub.Tensor": _alpha,
            "sub.Scalar": _alpha, "elu.default": _elu}


class _FloorNode:
    """``floor_divide(a, b)`` seen as ``div(a, b, rounding_mode="floor")``."""

    def __init__(self, node):
        self.args = tuple(node.args[:2]) + ("floor",)
        self.kwargs = {}


class _Node:
    """A graph node as TVM's converters read it (``args``, ``kwargs``), with other arguments."""

    def __init__(self, args, kwargs=None):
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})


def module_path(node) -> str:
    """The dotted path of the innermost module ``node`` was traced in ("" for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, module_type = list(stack.values())[-1]
    type_name = getattr(module_type, "__name__", str(module_type).rsplit(".", 1)[-1])
    return f"{path} ({type_name.strip(chr(39))})" if path else ""


def _check_unsupported_func_type(self, nodes):
    """Replaces BaseFXGraphImporter._check_unsupported_func_type, whose AssertionError names
    the operators but not where they are: raise UnsupportedOperatorError naming each
    unsupported aten operator and the module paths it occurs at. It runs before any node is
    converted: it also makes every converter's failure a ConversionError naming the operator.
    Operators drawing random numbers are refused unless their converter is ``seeded``."""
    where, random = {}, {}
    for node in nodes:
        if node.op != "call_function":
            continue
        name = node.target.__name__
        if _draws_random_numbers(node.target) and not getattr(
                self.convert_map.get(name), "seeded", False):
            found = random
        elif name not in self.convert_map:
            found = where
        else:
            continue
        paths = found.setdefault(name, [])
        path = module_path(node) or "the top-level module's forward"
        if path not in paths:
            paths.append(path)
    if random:
        found = "; ".join(f"aten.{name} at {', '.join(paths)}" for name, paths in random.items())
        raise UnsupportedOperatorError(
            f"{found} draws random numbers: raf_dist captures only element-wise dropout "
            "(nn.Dropout, F.dropout, in place or not) as masks the Trainer draws every step, and "
            "TVM's importer would make any other random operator a fixed tensor (a constant, "
            "zeros or its input) or fail on it. Use nn.Dropout / F.dropout in that module "
            "(nn.Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout and RReLU are not "
            "supported), or pass the random tensor in as an input")
    if where:
        found = "; ".join(f"aten.{name} at {', '.join(paths)}" for name, paths in where.items())
        raise UnsupportedOperatorError(
            f"the Relax importer does not support {found}. Replace the operator in that module, "
            "or register a converter for it in raf_dist/frontend/torch_ops.py")
    self.convert_map = {name: _naming_failures(name, convert)
                        for name, convert in self.convert_map.items()}


def _draws_random_numbers(target) -> bool:
    import torch

    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def seeded(convert):
    """Mark ``convert`` (a converter of an operator that draws random numbers) as capturing the
    randomness as seeded inputs, so the check above lets the operator through."""
    convert.seeded = True
    return convert


class ConversionError(ValueError):
    """A converter of the Relax importer (TVM's, or one of this module's) failed on an aten
    operator it supports: raised by from_pytorch naming the operator and where it occurs."""


def _naming_failures(name, convert):
    """``convert`` (a convert_map entry) raising ConversionError naming the aten operator, its
    graph node and module path, so a failure is not mistaken for torch.export's."""
    if getattr(convert, "names_failures", False):
        return convert

    def run(node, *importer):
        try:
            return convert(node, *importer)
        except (NotImplementedError, ConversionError):
            raise  # raf_dist's own, already naming the problem
        except Exception as err:
            path = module_path(node) or "the top-level module's forward"
            raise ConversionError(
                f"the Relax importer failed to convert aten.{name} (graph node {node.name}) at "
                f"{path}: {str(err).strip() or type(err).__name__}. torch.export and its "
                "decomposition succeeded; the converter is TVM's (tvm.relax.frontend.torch) "
                "unless raf_dist/frontend/torch_ops.py registers one for this operator: "
                "correct or register it there") from err

    run.names_failures = True
    return run


def install_unsupported_op_check() -> None:
    """Patch TVM's importer (once) so an unknown operator raises UnsupportedOperatorError."""
    from tvm.relax.frontend.torch.base_fx_graph_translator import BaseFXGraphImporter

    BaseFXGraphImporter._check_unsupported_func_type = _check_unsupported_func_type
