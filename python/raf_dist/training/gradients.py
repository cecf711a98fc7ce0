"""Gradients TVM 0.27 lacks, registered at a level above TVM's own (10).

Each function gets (orig_var, orig_call, output_grad, ctx) and returns one partial per
argument. Ops that produce masks, indices or constants (arange, logical and bitwise ops)
get ``no_grad`` partials: nothing differentiable flows through them.
Checked against finite differences in float64 by tests/numeric/test_gradients.py.
"""
import math
from typing import List, Set

import tvm
from tvm import relax
from tvm.relax.op import grad as grad_ops
from tvm.relax.op.base import register_gradient

from ..ir.ops import GRADIENT_LEVEL as _LEVEL
from ..ir.ops import gradient as _register
from . import layer_norm

op = relax.op
#: what a gradient function returns: one partial per argument of the call
Partials = List[relax.Expr]


def _const(value: float, like: relax.Expr) -> relax.Expr:
    return relax.const(value, like.ty.dtype)


def _no_grads(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
              ctx: relax.BlockBuilder) -> Partials:
    return [grad_ops.no_grad(arg) for arg in orig_call.args]


for _name in ("relax.arange", "relax.logical_and", "relax.logical_or", "relax.logical_not",
              "relax.logical_xor", "relax.bitwise_not", "relax.bitwise_and", "relax.bitwise_or",
              "relax.bitwise_xor", "relax.argmax", "relax.argmin"):
    if tvm.ir.Op.get(_name).get_attr("FPrimalGradient") is None:
        register_gradient(_name, _no_grads, level=_LEVEL)


def _is_float_type(ty: relax.Type) -> bool:
    if isinstance(ty, relax.TupleType):
        return any(_is_float_type(f) for f in ty.fields)
    # tensors only: a PrimValue attribute-like argument (clip's bounds) carries no gradient
    return isinstance(ty, relax.TensorType) and str(ty.dtype).startswith(("float", "bfloat"))


def carries_no_gradient(call: relax.Call) -> bool:
    """True when no gradient can flow through ``call``: its result is not floating point
    (masks, indices, counts) or none of its arguments is (integer/bool computations such as
    attention masks built from int64 positions). Such bindings are constants to training."""
    return not _is_float_type(call.ty) or not any(_is_float_type(a.ty) for a in call.args
                                                  if isinstance(a, relax.Expr))


_INTEGER_ONLY: Set[str] = set()  # ops whose only registered gradient is _integer_only_grads below
_FALLBACK_LEVEL = 1  # below TVM's (10) and ours (11): a real gradient registered later wins


def _integer_only_grads(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                        ctx: relax.BlockBuilder) -> Partials:
    if not carries_no_gradient(orig_call):
        raise NotImplementedError(f"{orig_call.op.name} has no gradient for floating-point "
                                  "inputs; register one in raf_dist/training/gradients.py")
    return [grad_ops.no_grad(arg) for arg in orig_call.args]


def has_gradient(call: relax.Call) -> bool:
    """True when TVM's Gradient pass can differentiate ``call``: its op has a gradient, or no
    gradient flows through it (``carries_no_gradient``); in the second case an op without
    one gets a gradient of no partials, valid only for such calls (it raises on others)."""
    name = call.op.name
    registered = call.op.get_attr("FPrimalGradient") is not None
    if registered and name not in _INTEGER_ONLY:
        return True
    if not carries_no_gradient(call):
        return False
    if not registered:
        register_gradient(name, _integer_only_grads, level=_FALLBACK_LEVEL)
        _INTEGER_ONLY.add(name)
    return True


@_register("relax.astype")
def _astype_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                 ctx: relax.BlockBuilder) -> Partials:
    """TVM's, except that a cast from integer/bool (a mask or position turned into a float)
    passes nothing back: the integer computation before it needs no gradient."""
    x = orig_call.args[0]
    if not _is_float_type(x.ty):
        return [grad_ops.no_grad(x)]
    return [op.astype(output_grad, x.ty.dtype)]


@_register("relax.tril")
def _tril_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
               ctx: relax.BlockBuilder) -> Partials:
    return [op.tril(output_grad, orig_call.args[1]), grad_ops.no_grad(orig_call.args[1])]


@_register("relax.triu")
def _triu_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
               ctx: relax.BlockBuilder) -> Partials:
    # TVM's own returns one partial for two arguments (k is an argument in 0.27)
    return [op.triu(output_grad, orig_call.args[1]), grad_ops.no_grad(orig_call.args[1])]


@_register("relax.erf")
def _erf_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
              ctx: relax.BlockBuilder) -> Partials:
    x = orig_call.args[0]
    slope = op.multiply(_const(2 / math.sqrt(math.pi), x), op.exp(op.negative(op.multiply(x, x))))
    return [op.multiply(output_grad, slope)]


@_register("relax.nn.gelu")
def _gelu_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
               ctx: relax.BlockBuilder) -> Partials:
    # gelu(x) = x * Phi(x); gelu'(x) = Phi(x) + x * phi(x)
    x = orig_call.args[0]
    cdf = op.multiply(_const(0.5, x), op.add(_const(1.0, x),
                                             op.erf(op.multiply(x, _const(1 / math.sqrt(2), x)))))
    pdf = op.multiply(_const(1 / math.sqrt(2 * math.pi), x),
                      op.exp(op.multiply(_const(-0.5, x), op.multiply(x, x))))
    return [op.multiply(output_grad, op.add(cdf, op.multiply(x, pdf)))]


@_register("relax.nn.gelu_tanh")
def _gelu_tanh_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                    ctx: relax.BlockBuilder) -> Partials:
    # 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3), c = sqrt(2/pi)
    x = orig_call.args[0]
    c = math.sqrt(2 / math.pi)
    x2 = op.multiply(x, x)
    u = op.multiply(_const(c, x), op.add(x, op.multiply(_const(0.044715, x), op.multiply(x2, x))))
    t = op.tanh(u)
    du = op.multiply(_const(c, x), op.add(_const(1.0, x), op.multiply(_const(3 * 0.044715, x), x2)))
    sech2 = op.subtract(_const(1.0, x), op.multiply(t, t))
    slope = op.add(op.multiply(_const(0.5, x), op.add(_const(1.0, x), t)),
                   op.multiply(op.multiply(_const(0.5, x), x), op.multiply(sech2, du)))
    return [op.multiply(output_grad, slope)]


@_register("relax.rsqrt")
def _rsqrt_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                ctx: relax.BlockBuilder) -> Partials:
    y = orig_var  # d/dx x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
    cube = op.multiply(y, op.multiply(y, y))
    return [op.multiply(output_grad, op.multiply(_const(-0.5, y), cube))]


@_register("relax.square")
def _square_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                 ctx: relax.BlockBuilder) -> Partials:
    x = orig_call.args[0]
    return [op.multiply(output_grad, op.multiply(_const(2.0, x), x))]


@_register("relax.nn.leakyrelu")
def _leakyrelu_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                    ctx: relax.BlockBuilder) -> Partials:
    x = orig_call.args[0]
    alpha = float(orig_call.attrs.alpha)
    slope = op.where(op.greater(x, _const(0.0, x)), op.ones_like(x),
                     op.full_like(x, _const(alpha, x)))
    return [op.multiply(output_grad, slope)]


@_register("relax.nn.softplus")
def _softplus_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                   ctx: relax.BlockBuilder) -> Partials:
    x = orig_call.args[0]
    beta = float(orig_call.attrs.beta)
    return [op.multiply(output_grad, op.sigmoid(op.multiply(x, _const(beta, x))))]


@_register("relax.nn.layer_norm")
def _layer_norm_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                     ctx: relax.BlockBuilder) -> Partials:
    """y = xhat * gamma + beta, xhat = (x - mean) * rstd over ``axes``:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma;
    dgamma = sum(dy * xhat), dbeta = sum(dy) over the other axes."""
    x, gamma, beta = orig_call.args
    ndim = x.ty.ndim
    axes = sorted(int(a) % ndim for a in orig_call.attrs.axes)
    batch_axes = [a for a in range(ndim) if a not in axes]
    eps = float(orig_call.attrs.epsilon)
    fused = layer_norm.fused_grads(x, gamma, beta, output_grad, axes, eps)
    if fused is not None:  # trailing axes, static shapes: two row-wise kernels
        return fused
    mean = ctx.emit(op.mean(x, axes, keepdims=True))
    centered = ctx.emit(op.subtract(x, mean))
    var = ctx.emit(op.mean(op.multiply(centered, centered), axes, keepdims=True))
    rstd = ctx.emit(op.rsqrt(op.add(var, _const(eps, x))))
    xhat = ctx.emit(op.multiply(centered, rstd))
    g = ctx.emit(op.multiply(output_grad, gamma))
    mean_g = op.mean(g, axes, keepdims=True)
    mean_gx = op.mean(op.multiply(g, xhat), axes, keepdims=True)
    dx = op.multiply(rstd, op.subtract(op.subtract(g, mean_g), op.multiply(xhat, mean_gx)))
    dgamma = op.sum(op.multiply(output_grad, xhat), batch_axes) if batch_axes else \
        op.multiply(output_grad, xhat)
    dbeta = op.sum(output_grad, batch_axes) if batch_axes else output_grad
    return [dx, dgamma, dbeta]


def _shape_of(expr: relax.Expr) -> List[int]:
    return [int(d) for d in expr.ty.shape]


@_register("relax.squeeze")
def _squeeze_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                  ctx: relax.BlockBuilder) -> Partials:
    return [op.reshape(output_grad, _shape_of(orig_call.args[0]))]


@_register("relax.flatten")
def _flatten_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                  ctx: relax.BlockBuilder) -> Partials:
    return [op.reshape(output_grad, _shape_of(orig_call.args[0]))]


def _extreme_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                  ctx: relax.BlockBuilder) -> Partials:
    """max / min over axes: the gradient goes to the extreme elements, split evenly between
    ties (as torch.amax / amin)."""
    x = orig_call.args[0]
    ndim = x.ty.ndim
    axis = orig_call.attrs.axis
    axes = list(range(ndim)) if axis is None else sorted(int(a) % ndim for a in axis)
    y, dy = orig_var, output_grad
    if not orig_call.attrs.keepdims:
        y = op.expand_dims(y, axes)
        dy = op.expand_dims(dy, axes)
    hit = ctx.emit(op.astype(op.equal(x, y), x.ty.dtype))
    count = op.sum(hit, axes, keepdims=True)
    return [op.multiply(hit, op.divide(dy, count))]


register_gradient("relax.max", _extreme_grad, level=_LEVEL)
register_gradient("relax.min", _extreme_grad, level=_LEVEL)


@_register("relax.take")
def _take_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
               ctx: relax.BlockBuilder) -> Partials:
    """TVM's take_backward needs 1-D indices: flatten the index dimensions of the output
    gradient and of the indices, then scatter-add as TVM does."""
    x, indices = orig_call.args
    axis = orig_call.attrs.axis
    idx_shape = _shape_of(indices)
    if len(idx_shape) != 1:
        numel = 1
        for d in idx_shape:
            numel *= d
        if axis is None:
            flat_grad_shape = [numel]
        else:
            axis = int(axis) % x.ty.ndim
            x_shape = _shape_of(x)
            flat_grad_shape = x_shape[:axis] + [numel] + x_shape[axis + 1:]
        output_grad = ctx.emit(op.reshape(output_grad, flat_grad_shape))
        indices = ctx.emit(op.reshape(indices, [numel]))
    return [grad_ops.take_backward(output_grad, x, indices, orig_call.attrs.axis),
            grad_ops.no_grad(orig_call.args[1])]


@_register("relax.grad.take_backward")
def _scatter_add_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                      ctx: relax.BlockBuilder) -> Partials:
    """take_backward used forward, as a scatter-add (passes/embedding_pooled.py sums each
    bag's rows with it): row i of the result is the sum of the source rows whose index is i,
    so a source row's gradient is the result gradient's row at its index (a take). The
    second argument only gives the result's shape."""
    source, like, indices = orig_call.args
    return [op.take(output_grad, indices, axis=orig_call.attrs.axis),
            grad_ops.no_grad(like), grad_ops.no_grad(indices)]


@_register("relax.clip")
def _clip_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
               ctx: relax.BlockBuilder) -> Partials:
    x, low, high = orig_call.args
    inside = op.logical_and(op.greater_equal(x, _const(float(low.value), x)),
                            op.less_equal(x, _const(float(high.value), x)))
    return [op.multiply(output_grad, op.astype(inside, x.ty.dtype)),
            grad_ops.no_grad(low), grad_ops.no_grad(high)]


def _ints(tuple_expr: relax.Tuple) -> List[int]:
    return [int(v.value) if hasattr(v, "value") else int(v) for v in tuple_expr.fields]


@_register("relax.strided_slice")
def _strided_slice_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                        ctx: relax.BlockBuilder) -> Partials:
    """Unit strides: the slice's gradient is the output gradient padded back with zeros."""
    x = orig_call.args[0]
    axes, begin, end = (_ints(a) for a in orig_call.args[1:4])
    strides = _ints(orig_call.args[4]) if len(orig_call.args) > 4 else [1] * len(axes)
    if any(s != 1 for s in strides):
        raise NotImplementedError("the gradient of strided_slice with strides != 1 is not "
                                  "implemented; slice with unit strides")
    shape = _shape_of(x)
    pad_width = [0] * (2 * len(shape))
    for axis, b, e in zip(axes, begin, end):
        axis %= len(shape)
        dim = shape[axis]
        b = min(max(b + dim if b < 0 else b, 0), dim)
        e = min(max(e + dim if e < 0 else e, 0), dim)
        pad_width[2 * axis], pad_width[2 * axis + 1] = b, dim - e
    partials = [op.nn.pad(output_grad, pad_width)]
    return partials + [grad_ops.no_grad(a) for a in orig_call.args[1:]]


@_register("relax.nn.pad")
def _pad_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
              ctx: relax.BlockBuilder) -> Partials:
    if orig_call.attrs.pad_mode != "constant":
        raise NotImplementedError(f"the gradient of pad mode {orig_call.attrs.pad_mode!r} is "
                                  "not implemented; use constant padding")
    shape = _shape_of(orig_call.args[0])
    width = [int(w) for w in orig_call.attrs.pad_width]
    begin = [width[2 * i] for i in range(len(shape))]
    end = [b + d for b, d in zip(begin, shape)]
    return [op.strided_slice(output_grad, list(range(len(shape))), begin, end)]


@_register("relax.repeat")
def _repeat_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                 ctx: relax.BlockBuilder) -> Partials:
    """Each element is repeated r times in a row: fold the copies into a new axis, sum it."""
    x = orig_call.args[0]
    shape = _shape_of(x)
    repeats = int(orig_call.attrs.repeats)
    axis = orig_call.attrs.axis
    if axis is None:
        numel = 1
        for d in shape:
            numel *= d
        folded = op.reshape(output_grad, [numel, repeats])
        return [op.reshape(op.sum(folded, [1]), shape)]
    axis = int(axis) % len(shape)
    folded = op.reshape(output_grad, shape[:axis + 1] + [repeats] + shape[axis + 1:])
    return [op.sum(folded, [axis + 1])]


@_register("relax.tile")
def _tile_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
               ctx: relax.BlockBuilder) -> Partials:
    """y = x tiled r_i times along axis i: view the gradient as (r0, d0, r1, d1, ...) and sum
    over the r axes."""
    x = orig_call.args[0]
    shape = _shape_of(x)
    reps = [int(r) for r in orig_call.attrs.repeats]
    ndim = max(len(shape), len(reps))
    full_shape = [1] * (ndim - len(shape)) + shape
    reps = [1] * (ndim - len(reps)) + reps
    folded_shape = [v for r, d in zip(reps, full_shape) for v in (r, d)]
    folded = op.reshape(output_grad, folded_shape)
    summed = op.sum(folded, list(range(0, 2 * ndim, 2)))
    return [op.reshape(summed, shape)]


@_register("relax.gather_elements")
def _gather_elements_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                          ctx: relax.BlockBuilder) -> Partials:
    x, indices = orig_call.args
    scattered = op.scatter_elements(op.zeros_like(x), indices, output_grad,
                                    axis=int(orig_call.attrs.axis), reduction="add")
    return [scattered, grad_ops.no_grad(indices)]


@_register("relax.nn.rms_norm")
def _rms_norm_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                   ctx: relax.BlockBuilder) -> Partials:
    """y = xhat * w, xhat = x * rstd, rstd = 1/sqrt(mean(x^2) + eps) over ``axes``:
    dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w; dw = sum(dy * xhat) over the rest."""
    x, weight = orig_call.args
    ndim = x.ty.ndim
    axes = sorted(int(a) % ndim for a in orig_call.attrs.axes)
    batch_axes = [a for a in range(ndim) if a not in axes]
    eps = float(orig_call.attrs.epsilon)
    rstd = ctx.emit(op.rsqrt(op.add(op.mean(op.multiply(x, x), axes, keepdims=True),
                                    _const(eps, x))))
    xhat = ctx.emit(op.multiply(x, rstd))
    g = ctx.emit(op.multiply(output_grad, weight))
    mean_gx = op.mean(op.multiply(g, xhat), axes, keepdims=True)
    dx = op.multiply(rstd, op.subtract(g, op.multiply(xhat, mean_gx)))
    dweight = op.multiply(output_grad, xhat)
    if batch_axes:
        dweight = op.sum(dweight, batch_axes)
    return [dx, dweight]


@_register("relax.nn.attention")
def _attention_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                    ctx: relax.BlockBuilder) -> Partials:
    """softmax(q k^T * scale + bias, causal) v on (batch, seq, heads, dim) tensors: recompute
    the probabilities p, then dv = p^T dy, ds = p * (dp - rowsum(dp * p)) with dp = dy v^T,
    dq = ds k * scale, dk = ds^T q * scale, dbias = ds."""
    import numpy as np

    attrs = orig_call.attrs
    if attrs.window_size is not None:
        raise NotImplementedError("the gradient of windowed attention is not implemented")
    q, k, v = orig_call.args[:3]
    bias = orig_call.args[3] if len(orig_call.args) > 3 else None
    seq, seq_kv, dim = _shape_of(q)[1], _shape_of(k)[1], _shape_of(q)[3]
    scale = float(attrs.scale.value) if attrs.scale is not None else 1.0 / math.sqrt(dim)
    bhsd = [0, 2, 1, 3]
    qt = ctx.emit(op.permute_dims(q, bhsd))
    kt = ctx.emit(op.permute_dims(k, bhsd))
    vt = ctx.emit(op.permute_dims(v, bhsd))
    scores = op.multiply(op.matmul(qt, op.permute_dims(kt, [0, 1, 3, 2])), _const(scale, q))
    if bias is not None:
        scores = op.add(scores, bias)
    if attrs.causal_mask is not None:
        offset = 0 if attrs.causal_mask == "TopLeft" else seq_kv - seq
        keep = relax.const(np.tril(np.ones((seq, seq_kv), dtype=bool), offset))
        scores = op.where(keep, scores, _const(float("-inf"), q))
    probs = ctx.emit(op.nn.softmax(ctx.emit(scores), axis=-1))
    dout = ctx.emit(op.permute_dims(output_grad, bhsd))
    dv = op.matmul(op.permute_dims(probs, [0, 1, 3, 2]), dout)
    dprobs = ctx.emit(op.matmul(dout, op.permute_dims(vt, [0, 1, 3, 2])))
    rowsum = op.sum(op.multiply(dprobs, probs), [-1], keepdims=True)
    dscores = ctx.emit(op.multiply(probs, op.subtract(dprobs, rowsum)))
    dq = op.multiply(op.matmul(dscores, kt), _const(scale, q))
    dk = op.multiply(op.matmul(op.permute_dims(dscores, [0, 1, 3, 2]), qt), _const(scale, q))
    partials = [op.permute_dims(dq, bhsd), op.permute_dims(dk, bhsd), op.permute_dims(dv, bhsd)]
    if bias is not None:
        partials.append(op.collapse_sum_to(dscores, _shape_of(bias)))
    return partials
