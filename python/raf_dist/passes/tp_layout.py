"""Where each value of a forward graph is split across the T tensor-parallel ranks.

A split value keeps one *rank digit* of its row-major flat index: element ``i`` lives on rank
``(i // (hi // T)) % T``, where ``hi`` is the flat stride just above the digit. ``hi`` does not
change under reshape, squeeze or expand_dims (the flat index does not), so one integer follows
a head split through ``[B, S, C] -> [B, S, H, D] -> [B*H, S, D]`` without case analysis. In a
given shape the digit must sit inside one dimension ``j`` (``size = hi / stride_j`` elements of
it per segment, ``shape[j] / size`` segments: a fused qkv weight is 3 segments, each split
T ways); the rank's local tensor is the global one with the digit removed, i.e. ``shape[j] /
T``. ``PARTIAL`` marks a matmul result that holds this rank's partial sum (row-parallel).

``propagate`` walks a function's bindings once, from the split parameters (``placements``),
with one rule per op. It raises ``Unsplittable`` naming the first binding it cannot keep split
(a norm or softmax over the split dimension, an op it does not know, a split value reaching
the output, ...), ``Request`` when a replicated parameter must be split too to continue (a
column layer's bias, a row layer's weight) and ``Resegment`` when the split dimension turns out
to hold equal segments (qkv). The search (tensor_parallel.py) answers the last two and tries
again; there is no fix-point magic in here.
"""
import contextlib
import dataclasses

import tvm
from tvm import relax

from ..ir.ops import ATTENTION  # (_op_name keeps raf_dist's prefix)

PARTIAL = "partial"

_UNARY = {"nn.relu", "nn.gelu", "nn.gelu_tanh", "nn.silu", "sigmoid", "tanh", "exp", "log",
          "sqrt", "rsqrt", "negative", "abs", "astype", "square", "erf", "clip", "nn.leakyrelu",
          "nn.softplus", "sin", "cos", "round", "floor", "ceil", "logical_not", "bitwise_not",
          "zeros_like", "ones_like", "full_like", "sign", "isfinite", "isnan", "isinf"}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "power", "maximum", "minimum",
                "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
                "logical_and", "logical_or", "floor_divide", "where", "bitwise_and"}
_SAME_FLAT = {"reshape", "expand_dims", "squeeze", "flatten"}  # flat index unchanged
_REDUCE = {"sum", "mean", "max", "min", "prod", "variance", "std"}
_NORM = {"nn.layer_norm", "nn.rms_norm", "nn.group_norm"}


class Unsplittable(Exception):
    """The graph cannot stay split at ``var`` (a message says why)."""

    def __init__(self, var, why):
        super().__init__(f"{var.name}: {why}")
        self.var, self.why = var, why


@dataclasses.dataclass
class Request(Exception):
    """Parameter ``param`` must be split along ``dim``, ``size`` elements per segment."""

    param: relax.Var
    dim: int
    size: int


@dataclasses.dataclass
class Resegment(Exception):
    """The split dimension of the value from parameter ``param`` holds ``segments`` equal
    segments (a fused projection later cut in pieces): split each segment instead."""

    segments: int


#: {expr: static shape} while a plan is searched (``shape_cache``): the search propagates
#: the same function once per candidate (772 times for a 96-layer GPT-3), and reading a
#: shape through TVM's FFI took 130 of its 245 s
_SHAPES: list = []


@contextlib.contextmanager
def shape_cache():
    """Within the block, ``static_shape`` remembers each expression's shape (types are
    immutable); the memo is dropped on exit."""
    _SHAPES.append({})
    try:
        yield
    finally:
        _SHAPES.pop()


def static_shape(expr):
    if not _SHAPES:
        return _type_shape(expr.ty)
    memo = _SHAPES[-1]
    shape = memo.get(expr, _MISSING)
    if shape is _MISSING:
        shape = memo[expr] = _type_shape(expr.ty)
    return shape


_MISSING = object()


def field_shapes(var):
    """The static shapes of a tuple-typed value's fields (a split's pieces)."""
    return [_type_shape(ty) for ty in var.ty.fields]


def _type_shape(ty):
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return tuple(int(d) for d in ty.shape)
    except TypeError:  # symbolic
        return None


def strides(shape):
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return list(reversed(out))


def dim_of(shape, hi, tp):
    """(dimension, elements per segment) holding the rank digit ``hi`` in ``shape``, or None
    when the digit does not sit whole inside one dimension."""
    for j, (d, st) in enumerate(zip(shape, strides(shape))):
        low = hi // tp
        if hi % tp == 0 and low % st == 0 and st <= low and hi <= st * d and (st * d) % hi == 0:
            return j, hi // st
    return None


def hi_of(shape, dim, size):
    return strides(shape)[dim] * size


def local_shape(shape, hi, tp):
    if hi is None:
        return tuple(shape)
    j, _ = dim_of(shape, hi, tp)
    return tuple(d // tp if i == j else d for i, d in enumerate(shape))


def _op_name(call):
    name = call.op.name
    return name[len("relax."):] if name.startswith("relax.") else name


@dataclasses.dataclass
class Propagation:
    """The result: ``layouts[var]`` = hi of each split value; ``partials``: the matmuls whose
    result is this rank's partial sum (the rewrite follows each by g, so their users see a
    replicated value); ``copies``: {replicated value read by a split op whose gradient
    therefore needs f (tp_copy): the value f goes on}, the latter before any reshape or cast,
    so that q, k and v reading three reshapes of one activation share one f (one backward
    allreduce, as Megatron's)."""

    layouts: dict
    copies: dict
    partials: set
    vocab_takes: set = dataclasses.field(default_factory=set)  # embedding lookups (partial)
    output_split: bool = False  # the output is split along its last (class) dimension


def propagate(func, tp, placements, params, needs_grad, split_output=False):
    """Layouts of ``func``'s bindings given ``placements`` {param var: (dim, size)}.
    ``params``: the function's parameter vars that may be split on request;
    ``needs_grad``: vars through which a gradient flows to a trained parameter;
    ``split_output``: the output may stay split along its last dimension (logits for a
    vocabulary-parallel cross-entropy)."""
    layouts, copies, partials = {}, {}, set()
    for p, (dim, size) in placements.items():
        shape = static_shape(p)
        if shape[dim] % size or size % tp:
            raise Unsplittable(p, f"dimension {dim} ({shape[dim]}) of {list(shape)} does not "
                                  f"split into {tp} equal parts per segment of {size}")
        layouts[p] = hi_of(shape, dim, size)
    rule = SplitRules(tp, layouts, copies, params, needs_grad, partials)
    for block in func.body.blocks:
        for binding in block.bindings:
            rule.bind(binding)
    out = func.body.body
    first = out.fields[0] if isinstance(out, relax.Tuple) else out  # (output, *buffers)
    output_split = False
    for var in relax.analysis.free_vars(out):
        if var not in layouts:
            continue
        shape = static_shape(var)
        if not (split_output and var.same_as(first)
                and dim_of(shape, layouts[var], tp) == (len(shape) - 1, shape[-1])):
            raise Unsplittable(var, "a split value is an output of the forward" + (
                "" if split_output else " (a vocabulary-parallel loss needs cross_entropy)"))
        output_split = True
    return Propagation(layouts, copies, partials, rule.vocab_takes, output_split)


class SplitRules:
    """One rule per op: the layout of a binding from its operands' (``propagate``; the
    context-parallel pass subclasses it with the sequence as the split)."""

    def __init__(self, tp, layouts, copies, params, needs_grad, partials):
        self.tp, self.layouts, self.copies, self.partials = tp, layouts, copies, partials
        self.params, self.needs_grad = params, needs_grad
        self.bound = {}  # var -> value, to trace a replicated weight back to its parameter
        self.vocab_takes = set()

    def bind(self, binding):
        var, value = binding.var, binding.value
        self.bound[var] = value
        if isinstance(value, relax.Var):
            if value in self.layouts:
                self.layouts[var] = self.layouts[value]
            return
        if isinstance(value, relax.TupleGetItem):
            layout = self.layouts.get(value.tuple_value)
            if isinstance(layout, tuple):
                if layout[value.index] is not None:
                    self.layouts[var] = layout[value.index]
            elif layout is not None:
                raise Unsplittable(var, "an element of a split tuple")
            return
        operands = _tensor_operands(value)
        if not any(a in self.layouts for a in operands):
            return
        if not isinstance(value, relax.Call) or not hasattr(value.op, "name"):
            raise Unsplittable(var, f"{type(value).__name__} of a split value")
        layout = self.rule(var, value)
        if layout == PARTIAL:
            self.partials.add(var)
        elif layout is not None:
            self.layouts[var] = layout

    # ---- helpers ---------------------------------------------------------------------------
    def split_dim(self, expr):
        """(dim, size) of a split operand, None when replicated."""
        hi = self.layouts.get(expr)
        if hi is None:
            return None
        found = dim_of(static_shape(expr), hi, self.tp)
        if found is None:  # cannot happen for a value this module placed
            raise Unsplittable(expr, "lost track of the split dimension")
        return found

    def replicated_operand(self, var, operand, dim, size, shape_dim):
        """A replicated operand meets the split at its dimension ``dim`` (None: absent);
        fine when broadcast there, a request when it is a parameter (or a transposed one)."""
        shape = static_shape(operand)
        if dim is None or dim < 0 or shape[dim] == 1:
            self.note_copy(operand)
            return
        if shape[dim] != shape_dim:
            raise Unsplittable(var, f"operand shapes {list(shape)} do not line up")
        param, pdim = self.trace_param(operand, dim)
        if param is None:
            raise Unsplittable(var, f"a replicated {list(shape)} value meets the split "
                                    f"dimension {dim} (only parameters are split on demand)")
        raise Request(param, pdim, size)

    def trace_param(self, operand, dim):
        if operand in self.params:
            return operand, dim
        value = self.bound.get(operand)
        if (isinstance(value, relax.Call) and _op_name(value) == "permute_dims"
                and value.args[0] in self.params):
            axes = value.attrs.axes
            axes = list(range(len(static_shape(operand))))[::-1] if axes is None else [
                int(a) for a in axes]
            return value.args[0], axes[dim]
        return None, None

    def note_copy(self, operand):
        if isinstance(operand, relax.Var) and operand in self.needs_grad:
            root = operand
            while True:
                value = self.bound.get(root)
                if isinstance(value, relax.Call) and _op_name(value) in ("reshape", "astype"):
                    root = value.args[0]
                else:
                    break
            self.copies[operand] = root

    def aligned(self, var, out_shape, operands):
        """Elementwise with numpy broadcasting: the output's hi, every operand checked."""
        hi, split = None, []
        for a in operands:
            found = self.split_dim(a)
            if found is not None:
                j, size = found
                shape = static_shape(a)
                jo = j + len(out_shape) - len(shape)
                if shape[j] != out_shape[jo]:
                    raise Unsplittable(var, "the split dimension is broadcast")
                h = hi_of(out_shape, jo, size)
                if hi is not None and h != hi:
                    raise Unsplittable(var, "operands split along different dimensions")
                hi, split = h, (jo, size)
        jo, size = split
        for a in operands:
            if a not in self.layouts and isinstance(a, (relax.Var, tvm.ir.expr.Constant)):
                shape = static_shape(a)
                if shape is None:
                    continue
                self.replicated_operand(var, a, jo - (len(out_shape) - len(shape)), size,
                                        out_shape[jo])
        return hi

    def rule(self, var, call):
        name = _op_name(call)
        out_shape = static_shape(var)
        x = call.args[0]
        if name in _UNARY:
            return self.layouts[x]
        if name in _ELEMENTWISE or name == "broadcast_to":
            return self.aligned(var, out_shape, [a for a in call.args if _is_tensor(a)])
        if name in _SAME_FLAT:
            hi = self.layouts[x]
            if dim_of(out_shape, hi, self.tp) is None:
                raise Unsplittable(var, f"reshape to {list(out_shape)} cuts the split "
                                        f"dimension (its parts do not divide by {self.tp})")
            return hi
        if name == "permute_dims":
            j, size = self.split_dim(x)
            axes = call.attrs.axes
            axes = list(range(len(out_shape)))[::-1] if axes is None else [int(a) for a in axes]
            return hi_of(out_shape, axes.index(j), size)
        if name in ("nn.softmax", "nn.log_softmax"):
            return self.keep_if_not(var, x, [int(call.attrs.axis)], out_shape)
        if name in _NORM:
            for a in call.args[1:]:
                self.note_copy(a)
            return self.keep_if_not(var, x, [int(a) for a in call.attrs.axes], out_shape)
        if name in _REDUCE:
            return self.reduce(var, call, out_shape)
        if name == "matmul":
            return self.matmul(var, call, out_shape)
        if name == "take":
            return self.take(var, call)
        if name == "split":
            return self.split(var, call)
        if name == "strided_slice":
            axes = [int(a) for a in call.args[1].values] if isinstance(
                call.args[1], relax.ShapeExpr) else [int(a) for a in call.args[1]]
            return self.keep_if_not(var, x, axes, out_shape)
        if name == ATTENTION:
            return self.attention(var, call)
        if name == "concat":
            fields = list(call.args[0].fields)
            if any(f not in self.layouts for f in fields):
                raise Unsplittable(var, "concatenates split and replicated values")
            return self.keep_if_not(var, fields[0], [int(call.attrs.axis)], out_shape,
                                    same=fields)
        raise Unsplittable(var, f"{call.op.name} is not known to the tensor-parallel pass")

    def attention(self, var, call):
        """The attention op with its heads split (dim 1 of q, k and v: Megatron's heads per
        rank; grouped key/value heads in the same contiguous blocks, so each rank's query
        heads read its own key/value heads): (output, log-sum-exp) split along their heads.
        A mask with a heads axis of its own would need splitting too: refused."""
        q, k, v, mask = call.args
        splits = [self.split_dim(a) for a in (q, k, v)]
        if any(s is None or s[0] != 1 for s in splits):
            raise Unsplittable(var, "attention whose q, k and v are not all split along "
                                    "their heads (dim 1)")
        shape = static_shape(mask)
        if shape is None or mask in self.layouts or (len(shape) >= 3 and shape[-3] > 1):
            raise Unsplittable(var, "attention with a mask per head (or of unknown shape)")
        return tuple(hi_of(o, 1, splits[0][1]) for o in field_shapes(var))

    def keep_if_not(self, var, x, axes, out_shape, same=None):
        j, size = self.split_dim(x)
        ndim = len(static_shape(x))
        if j in [a % ndim for a in axes]:
            raise Unsplittable(var, f"{var.name} works along the split dimension {j}")
        for other in same or ():
            if self.split_dim(other) != (j, size):
                raise Unsplittable(var, "operands split differently")
        return hi_of(out_shape, j, size)

    def reduce(self, var, call, out_shape):
        x = call.args[0]
        j, size = self.split_dim(x)
        ndim = len(static_shape(x))
        axes = range(ndim) if call.attrs.axis is None else [int(a) % ndim for a in
                                                             call.attrs.axis]
        if j in axes:
            raise Unsplittable(var, f"reduces over the split dimension {j}")
        jo = j if call.attrs.keepdims else j - sum(1 for a in axes if a < j)
        return hi_of(out_shape, jo, size)

    def matmul(self, var, call, out_shape):
        a, b = call.args[0], call.args[1]
        sa, sb = static_shape(a), static_shape(b)
        if len(sa) < 2 or len(sb) < 2:
            raise Unsplittable(var, "a split vector matmul")
        la, lb = self.split_dim(a), self.split_dim(b)
        no = len(out_shape)
        if la is not None and la[0] == len(sa) - 1:  # contracted: row parallel
            if lb is None:
                self.replicated_operand(var, b, len(sb) - 2, la[1], sa[-1])
            if lb != (len(sb) - 2, la[1]):
                raise Unsplittable(var, "the operands split the contracted dimension "
                                        "differently")
            return PARTIAL
        if lb is not None and lb[0] == len(sb) - 2:
            raise Unsplittable(var, "the weight is split along the contracted dimension but "
                                    "the activation is not")
        if la is not None and la[0] == len(sa) - 2:  # rows
            if lb is not None:
                raise Unsplittable(var, "both matmul operands split")
            self.note_copy(b)
            return hi_of(out_shape, no - 2, la[1])
        if lb is not None and lb[0] == len(sb) - 1:  # columns
            if la is not None:
                raise Unsplittable(var, "both matmul operands split")
            self.note_copy(a)
            return hi_of(out_shape, no - 1, lb[1])
        # split along a batch dimension
        split = la or lb
        operand, other = (a, b) if la is not None else (b, a)
        jo = split[0] + no - len(static_shape(operand))
        other_split = self.split_dim(other)
        if other_split is not None:
            if hi_of(out_shape, other_split[0] + no - len(static_shape(other)),
                     other_split[1]) != hi_of(out_shape, jo, split[1]):
                raise Unsplittable(var, "the operands split different batch dimensions")
        else:
            so = static_shape(other)
            self.replicated_operand(var, other, jo - (no - len(so)), split[1], out_shape[jo])
        return hi_of(out_shape, jo, split[1])

    def take(self, var, call):
        """Rows of a table split along the looked-up axis (a vocabulary-parallel embedding):
        each rank looks up the ids in its range, zeros the others, and g sums the pieces."""
        table, ids = call.args[0], call.args[1]
        shape = static_shape(table)
        found = self.split_dim(table)
        if found is None or ids in self.layouts:
            raise Unsplittable(var, "take with split indices")
        axis = call.attrs.axis
        if axis is None or found != (int(axis) % len(shape), shape[int(axis) % len(shape)]):
            raise Unsplittable(var, "take from a table split along another axis")
        self.vocab_takes.add(var)
        return PARTIAL

    def split(self, var, call):
        x = call.args[0]
        shape = static_shape(x)
        j, size = self.split_dim(x)
        axis = int(call.attrs.axis) % len(shape)
        outs = field_shapes(var)
        if axis != j:
            return tuple(hi_of(o, j, size) for o in outs)
        lengths = {o[j] for o in outs}
        if len(lengths) != 1:
            raise Unsplittable(var, "splits the split dimension into unequal pieces")
        length = lengths.pop()
        if length == size and shape[j] // size == len(outs):
            return tuple(hi_of(o, j, size) for o in outs)
        if shape[j] == size and length % self.tp == 0:  # one segment so far: resegment
            raise Resegment(len(outs))
        raise Unsplittable(var, f"cuts the split dimension into pieces of {length}")


def _is_tensor(expr):
    return isinstance(expr, (relax.Var, tvm.ir.expr.Constant)) and isinstance(expr.ty,
                                                                          relax.TensorType)


def _tensor_operands(value):
    if isinstance(value, relax.Call):
        out = []
        for a in value.args:
            if isinstance(a, relax.Tuple):
                out += [f for f in a.fields if isinstance(f, relax.Var)]
            elif isinstance(a, relax.Var):
                out.append(a)
        return out
    return [v for v in relax.analysis.free_vars(value)]
