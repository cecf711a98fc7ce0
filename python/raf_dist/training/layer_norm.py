"""Layer norm's backward as two row-wise ops: ``raf_dist.layer_norm_grad(x, gamma, dy)`` (the
input's gradient) and ``raf_dist.layer_norm_grad_weight(x, dy)`` (gamma's), each lowered to one
kernel that recomputes the rows' mean and 1/std from ``x`` (gamma's to two on a GPU:
``_legalize_grad_weight``); beta's gradient stays TVM's column sum of ``dy``.

Over rows ``x[r]`` of ``C`` elements, xhat = (x - mean) * rstd, g = dy * gamma:

    dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dgamma = sum over rows of dy * xhat

Why not the decomposition in Relax ops (gradients.py's ``_layer_norm_grad`` for the general
case): FuseOps cuts it at every reduction and fuses each reduction with its elementwise
consumer, so the centred input, its square, xhat, g and g * xhat are each written as a full
float32 tensor — eleven kernels per layer norm. Measured on the 23M GEMM GPT in bf16 (13 layer
norms, 1024 x 512 rows each; 2-core Xeon with AMX): 26 ms of the 326 ms step, against 5.9 ms
for PyTorch's ``native_layer_norm_backward``. Here each row is read into L1 once per kernel and
its four reductions run there (compiler/schedule.py's row-fused schedule), as PyTorch's and
Apex's fused layer norm do; the forward saves no statistics (the backward reads ``x`` again,
which AutoCast already keeps) so nothing changes in the forward graph that tensor and pipeline
parallelism partition.
"""
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tvm
from tvm import relax, te
from tvm.relax.transform.legalize_ops.common import register_legalize

from ..ir.ops import LAYER_NORM_GRAD, LAYER_NORM_GRAD_WEIGHT, register_op
from ..passes.auto_cast import LOW_DTYPES

#: an element of a TE computation as a function of its indices (tirx expressions)
Elementwise = Callable[..., Any]


def _out_dtype(call: relax.Call) -> str:
    """The result's dtype: ``out_dtype`` when the op reads 16-bit inputs (read_16_bit_inputs),
    else the input's."""
    out = call.attrs["out_dtype"] if "out_dtype" in call.attrs.keys() else None
    return str(out) if out else str(call.args[0].ty.dtype)


_INPUT = register_op(
    LAYER_NORM_GRAD, "the gradient of layer norm over the last axis with respect to its input",
    arguments=[("x", "the forward's input, (rows, C)"), ("gamma", "the scale, (C,)"),
               ("output_grad", "the gradient of the forward's output, (rows, C)")],
    infer=lambda call, ctx: relax.TensorType(call.args[0].ty.shape, _out_dtype(call)))
_WEIGHT = register_op(
    LAYER_NORM_GRAD_WEIGHT, "the gradient of layer norm over the last axis with respect to "
    "its scale: the column sums of output_grad * xhat",
    arguments=[("x", "the forward's input, (rows, C)"),
               ("output_grad", "the gradient of the forward's output, (rows, C)")],
    infer=lambda call, ctx: relax.TensorType([call.args[0].ty.shape[-1]], _out_dtype(call)))


def _attrs(epsilon: float, out_dtype: Optional[str] = None) -> Any:
    if out_dtype is None:
        return tvm.ir.make_node("ir.DictAttrs", epsilon=float(epsilon))
    return tvm.ir.make_node("ir.DictAttrs", epsilon=float(epsilon), out_dtype=str(out_dtype))


def fused_grads(x: relax.Expr, gamma: relax.Expr, beta: relax.Expr, output_grad: relax.Expr,
                axes: Sequence[int], epsilon: float) -> Optional[List[relax.Expr]]:
    """[dx, dgamma, dbeta] of ``layer_norm(x, gamma, beta, axes, epsilon)`` through the two
    fused ops, or None when they do not apply: the normalised axes must be the trailing ones
    and every shape static (the ops take (rows, C) views)."""
    shape = _static_shape(x)
    if shape is None or _static_shape(gamma) is None or _static_shape(beta) is None:
        return None
    ndim = len(shape)
    if sorted(axes) != list(range(ndim - len(axes), ndim)) or len(axes) == ndim:
        return None
    columns = math.prod(shape[ndim - len(axes):])
    rows = math.prod(shape[:ndim - len(axes)])
    op = relax.op
    x2 = op.reshape(x, [rows, columns])
    dy2 = op.reshape(output_grad, [rows, columns])
    dx = relax.Call(_INPUT, [x2, op.reshape(gamma, [columns]), dy2], attrs=_attrs(epsilon))
    dgamma = relax.Call(_WEIGHT, [x2, dy2], attrs=_attrs(epsilon))
    dbeta = op.sum(dy2, axis=[0])
    return [op.reshape(dx, shape), op.reshape(dgamma, _static_shape(gamma)),
            op.reshape(dbeta, _static_shape(beta))]


def _static_shape(expr: relax.Expr) -> Optional[List[int]]:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return [int(d) for d in ty.shape]
    except TypeError:  # symbolic
        return None


# ---- lowering (TE): statistics and sums in float32 (float64 for float64 tensors) ----

def _accumulator(x: te.Tensor) -> str:
    return "float64" if x.dtype == "float64" else "float32"


def _row_stats(x: te.Tensor, epsilon: float) -> Tuple[Elementwise, Elementwise, Elementwise]:
    """(x(i, c) in the accumulator's dtype, the rows' mean, their 1/std): two row reductions
    over ``x``."""
    rows, columns = x.shape
    acc = _accumulator(x)
    inv_c = tvm.tirx.const(1.0 / int(columns), acc)

    def value(i: Any, c: Any) -> Any:
        return x[i, c].astype(acc)

    k = te.reduce_axis((0, columns), name="k")
    total = te.compute((rows,), lambda i: te.sum(value(i, k), axis=k), name="ln_sum")
    k2 = te.reduce_axis((0, columns), name="k2")
    squares = te.compute((rows,), lambda i: te.sum(
        _square(value(i, k2) - total[i] * inv_c), axis=k2), name="ln_squares")

    def mean(i: Any) -> Any:
        return total[i] * inv_c

    def rstd(i: Any) -> Any:
        return tvm.tirx.rsqrt(squares[i] * inv_c + tvm.tirx.const(epsilon, acc))

    return value, mean, rstd


def _square(v: Any) -> Any:
    return v * v


def _grad_input_te(x: te.Tensor, gamma: te.Tensor, dy: te.Tensor, epsilon: float,
                   out_dtype: str) -> te.Tensor:
    rows, columns = x.shape
    acc = _accumulator(x)
    inv_c = tvm.tirx.const(1.0 / int(columns), acc)
    value, mean, rstd = _row_stats(x, epsilon)

    def g(i: Any, c: Any) -> Any:
        return dy[i, c].astype(acc) * gamma[c].astype(acc)

    k = te.reduce_axis((0, columns), name="kg")
    sum_g = te.compute((rows,), lambda i: te.sum(g(i, k), axis=k), name="ln_sum_g")
    k2 = te.reduce_axis((0, columns), name="kgx")
    sum_gx = te.compute((rows,), lambda i: te.sum(g(i, k2) * (value(i, k2) - mean(i)), axis=k2),
                        name="ln_sum_gx")

    def grad(i: Any, c: Any) -> Any:
        r = rstd(i)
        xhat = (value(i, c) - mean(i)) * r
        out = r * (g(i, c) - sum_g[i] * inv_c - xhat * (sum_gx[i] * r * inv_c))
        return out.astype(out_dtype)

    return te.compute((rows, columns), grad, name="layer_norm_grad")


def _xhat_dy(x: te.Tensor, dy: te.Tensor, epsilon: float) -> Elementwise:
    """``(i, c) -> dy * xhat`` in the accumulator's dtype: gamma's gradient before its
    column sums."""
    value, mean, rstd = _row_stats(x, epsilon)
    acc = _accumulator(x)
    return lambda i, c: dy[i, c].astype(acc) * (value(i, c) - mean(i)) * rstd(i)


def _column_sums(rows: Any, columns: Any, term: Elementwise, out_dtype: str) -> te.Tensor:
    """Each column's sum over the rows of ``term(r, c)``, accumulated in float64: the schedule
    walks the rows in order (a column reduction), and a float32 running sum over the 1024 rows
    of a GPT's batch drifts to twice PyTorch's own float32 error
    (tests/passes/test_layer_norm_grad.py); the terms stay float32, only the adds are
    float64, on a tensor the size of one activation."""
    r = te.reduce_axis((0, rows), name="r")
    total = te.compute((columns,), lambda c: te.sum(term(r, c).astype("float64"), axis=r),
                       name="ln_weight_sum")
    return te.compute((columns,), lambda c: total[c].astype(out_dtype),
                      name="layer_norm_grad_weight")


def _grad_weight_te(x: te.Tensor, dy: te.Tensor, epsilon: float, out_dtype: str) -> te.Tensor:
    """gamma's gradient as one kernel: the column sums of ``dy * xhat`` (the host's)."""
    rows, columns = x.shape
    return _column_sums(rows, columns, _xhat_dy(x, dy, epsilon), out_dtype)


register_legalize(LAYER_NORM_GRAD, lambda bb, call: bb.call_te(
    _grad_input_te, call.args[0], call.args[1], call.args[2], float(call.attrs["epsilon"]),
    _out_dtype(call), primfunc_name_hint="layer_norm_grad"))


def _xhat_dy_te(x: te.Tensor, dy: te.Tensor, epsilon: float) -> te.Tensor:
    """``dy * xhat`` (rows, C) in the accumulator's dtype (the GPU's first kernel)."""
    return te.compute(x.shape, _xhat_dy(x, dy, epsilon), name="layer_norm_xhat_dy")


def _column_sums_te(products: te.Tensor, out_dtype: str) -> te.Tensor:
    """The column sums of ``products`` (the GPU's second kernel)."""
    rows, columns = products.shape
    return _column_sums(rows, columns, lambda r, c: products[r, c], out_dtype)


def _legalize_grad_weight(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """On the host, one kernel (``_grad_weight_te``: each row read into cache once, the
    columns' sums walked in row order). On a GPU that kernel is one reduction over all rows
    for only C outputs: dlight's GeneralReduction gives it a single block of threads (0.77 ms
    a call for (1024, 128) rows on an H200, 1.3 ms for (2048, 512): 37-44% of the GPT steps'
    time, bench/RESULTS.md), so there it is two kernels, as the input's gradient's row
    kernel (a block per row) and the column sums (a reduction over the rows that dlight
    spreads over blocks of columns), the sums still in float64."""
    x, dy, epsilon = call.args[0], call.args[1], float(call.attrs["epsilon"])
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "cuda":
        return bb.call_te(_grad_weight_te, x, dy, epsilon, _out_dtype(call),
                          primfunc_name_hint="layer_norm_grad_weight")
    products = bb.emit(bb.call_te(_xhat_dy_te, x, dy, epsilon,
                                  primfunc_name_hint="layer_norm_xhat_dy"))
    return bb.call_te(_column_sums_te, products, _out_dtype(call),
                      primfunc_name_hint="layer_norm_grad_weight")


register_legalize(LAYER_NORM_GRAD_WEIGHT, _legalize_grad_weight)


# ---- mixed precision: the 16-bit tensors read as they are ----

_ASTYPE = tvm.ir.Op.get("relax.astype")
_RESHAPE = tvm.ir.Op.get("relax.reshape")


def read_16_bit_inputs(func: relax.Function) -> relax.Function:
    """``func`` with each layer norm gradient op reading the 16-bit tensors its float32
    ``x`` and ``output_grad`` were widened from (``reshape(astype(u, "float32"))``, as a
    bf16 step's backward makes them: passes/saved_precision.py, AutoCast's casts), the
    widening done as the kernel loads them and the result still float32 (``out_dtype``).
    Each widened copy was a tensor of its own, read by both ops and beta's column sum: two
    kernels and two float32 activations' worth of traffic per norm. The same values, bit
    for bit (widening is exact)."""
    if len(func.body.blocks) != 1:
        return func
    bindings = list(func.body.blocks[0].bindings)
    value = {b.var: b.value for b in bindings}

    def source(arg: relax.Expr) -> Optional[Tuple[relax.Expr, str]]:
        """(the 16-bit tensor ``arg`` widens, through one reshape, shaped as ``arg``; its
        dtype), or None."""
        inner: Any = value.get(arg)
        reshaped = isinstance(inner, relax.Call) and inner.op.same_as(_RESHAPE)
        if reshaped:
            inner = value.get(inner.args[0])
        if not (isinstance(inner, relax.Call) and inner.op.same_as(_ASTYPE)
                and str(arg.ty.dtype) == "float32"
                and str(inner.args[0].ty.dtype) in LOW_DTYPES):
            return None
        low = inner.args[0]
        return (relax.op.reshape(low, arg.ty.shape) if reshaped else low), str(low.ty.dtype)

    out: List[relax.Binding] = []
    changed = False
    for binding in bindings:
        call = binding.value
        if (isinstance(call, relax.Call) and (call.op.same_as(_INPUT) or call.op.same_as(_WEIGHT))
                and "out_dtype" not in call.attrs.keys()):
            args = list(call.args)
            data = [0, len(args) - 1]  # x and output_grad (gamma stays as it is)
            low = [(i, found) for i in data for found in [source(args[i])] if found is not None]
            if len(low) == len(data):
                for i, (expr, dtype) in low:
                    var = relax.DataflowVar(f"{binding.var.name}_low{i}",
                                            relax.TensorType(args[i].ty.shape, dtype))
                    out.append(relax.VarBinding(var, expr))
                    args[i] = var
                call = relax.Call(call.op, args, _attrs(call.attrs["epsilon"],
                                                        str(binding.var.ty.dtype)))
                binding = relax.VarBinding(binding.var, call)
                changed = True
        out.append(binding)
    if not changed:
        return func
    body = relax.SeqExpr([relax.DataflowBlock(out)], func.body.body)
    return relax.BlockBuilder().normalize(
        relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs))
