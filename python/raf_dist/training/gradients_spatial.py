"""Gradients TVM 0.27 lacks for the spatial ops of vision models (registered at level 11,
above TVM's own, as in gradients.py): conv3d, max_pool3d / avg_pool3d, adaptive_avg_pool2d to
any output size and group_norm, all on channel-first layouts (what the PyTorch importer
produces). Each is written with ops that already have legal, schedulable kernels, so the
backward needs no kernel of its own. Checked against PyTorch autograd by
tests/numeric/test_operators.py.
"""
from typing import Any, Callable, List, Sequence

import numpy as np
from tvm import relax
from tvm.relax.op import grad as grad_ops
from tvm.relax.op.base import register_gradient

# one registration level for every gradient raf_dist adds
from ..ir.ops import GRADIENT_LEVEL as _LEVEL
from ..ir.ops import gradient as _register

op = relax.op
#: what a gradient function returns: one partial per argument of the call
Partials = List[relax.Expr]
Gradient = Callable[[relax.Var, relax.Call, relax.Expr, relax.BlockBuilder], Partials]


def _shape_of(expr: relax.Expr) -> List[int]:
    return [int(d) for d in expr.ty.shape]


def _ints(values: Sequence[Any]) -> List[int]:
    return [int(v) for v in values]


def _require_layout(orig_call: relax.Call, expected: str) -> None:
    attrs = orig_call.attrs
    layouts = [getattr(attrs, k, None) for k in ("layout", "data_layout", "out_layout")]
    if any(layout not in (None, expected) for layout in layouts):
        raise NotImplementedError(f"the gradient of {orig_call.op.name} is implemented for the "
                                  f"{expected} layout only, got {layouts}")


@_register("relax.nn.conv3d")
def _conv3d_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                 ctx: relax.BlockBuilder) -> Partials:
    """As TVM's conv2d gradient, in 3-D: dx is the transposed convolution of dy with the
    weight; dw is the convolution of x (channels as batch) with dy (batch as channels), with
    stride and dilation swapped, cut back to the kernel size."""
    attrs = orig_call.attrs
    _require_layout(orig_call, "NCDHW")
    if attrs.kernel_layout != "OIDHW":
        raise NotImplementedError("the gradient of conv3d needs the OIDHW kernel layout")
    groups = int(attrs.groups)
    if groups != 1:
        raise NotImplementedError("the gradient of grouped conv3d is not implemented")
    x, weight = orig_call.args
    strides, dilation = _ints(attrs.strides), _ints(attrs.dilation)
    padding = _ints(attrs.padding)  # front, top, left, back, bottom, right
    in_spatial = _shape_of(x)[2:]
    out_spatial = _shape_of(orig_var)[2:]
    kernel = _shape_of(weight)[2:]
    # the transposed convolution's output size misses the rows the forward stride skipped
    output_padding = [in_spatial[i] - ((out_spatial[i] - 1) * strides[i] - padding[i]
                                       - padding[i + 3] + dilation[i] * (kernel[i] - 1) + 1)
                      for i in range(3)]
    dx = op.nn.conv3d_transpose(output_grad, weight, strides, padding, output_padding, dilation,
                                groups, "NCDHW", "IODHW", "NCDHW")
    # (C, N, D, H, W) conv (O, N, d, h, w) -> (C, O, kd', kh', kw')
    x_cn = op.permute_dims(x, [1, 0, 2, 3, 4])
    dy_on = op.permute_dims(output_grad, [1, 0, 2, 3, 4])
    dw = ctx.emit(op.nn.conv3d(x_cn, dy_on, strides=dilation, padding=padding,
                               dilation=strides))
    out_c, in_c = _shape_of(weight)[:2]
    got = _shape_of(dw)[2:]
    if got != kernel:
        dw = op.strided_slice(dw, [2, 3, 4], [0, 0, 0], kernel)
    return [dx, op.permute_dims(dw, [1, 0, 2, 3, 4])]


def _pool3d_grad(backward_2d: Callable[..., relax.Expr],
                 forward_2d: Callable[..., relax.Expr]) -> Gradient:
    """3-D pooling is separable: pool over (H, W) with a 2-D pool on (N, C*D, H, W), then
    over D with a (kd, 1) 2-D pool on (N, C, D, H'*W'). Max is separable exactly, so is the
    average (its divisor, the window's cell count with or without padding, is a product of
    per-axis counts). The gradient runs the two 2-D backward ops in reverse order."""

    def grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
             ctx: relax.BlockBuilder) -> Partials:
        attrs = orig_call.attrs
        _require_layout(orig_call, "NCDHW")
        x = orig_call.args[0]
        n, c, d, h, w = _shape_of(x)
        _, _, out_d, out_h, out_w = _shape_of(orig_var)
        kd, kh, kw = _ints(attrs.pool_size)
        sd, sh, sw = _ints(attrs.strides)
        dd, dh, dw = _ints(attrs.dilation)
        pf, pt, pl, pb, pbo, pr = _ints(attrs.padding)
        extra = {"ceil_mode": bool(attrs.ceil_mode),
                 "count_include_pad": bool(attrs.count_include_pad)}
        plane_args = ((kh, kw), (sh, sw), (pt, pl, pbo, pr), (dh, dw))
        depth_args = ((kd, 1), (sd, 1), (pf, 0, pb, 0), (dd, 1))
        planes = ctx.emit(op.reshape(x, [n, c * d, h, w]))
        pooled = ctx.emit(forward_2d(planes, *plane_args, **extra))
        depth_in = ctx.emit(op.reshape(pooled, [n, c, d, out_h * out_w]))
        dy = op.reshape(output_grad, [n, c, out_d, out_h * out_w])
        d_depth = ctx.emit(backward_2d(dy, depth_in, *depth_args, **extra))
        d_planes = op.reshape(d_depth, [n, c * d, out_h, out_w])
        dx = ctx.emit(backward_2d(d_planes, planes, *plane_args, **extra))
        return [op.reshape(dx, [n, c, d, h, w])]

    return grad


register_gradient("relax.nn.max_pool3d", _pool3d_grad(grad_ops.max_pool2d_backward,
                                                       op.nn.max_pool2d), level=_LEVEL)
register_gradient("relax.nn.avg_pool3d", _pool3d_grad(grad_ops.avg_pool2d_backward,
                                                       op.nn.avg_pool2d), level=_LEVEL)


def _adaptive_matrix(size_in: int, size_out: int, dtype: str) -> np.ndarray:
    """(size_out, size_in) averaging matrix of adaptive pooling along one axis: output cell i
    averages inputs [floor(i * n / m), ceil((i + 1) * n / m)) (PyTorch's windows)."""
    matrix = np.zeros((size_out, size_in), dtype)
    for i in range(size_out):
        begin = (i * size_in) // size_out
        end = -(-((i + 1) * size_in) // size_out)
        matrix[i, begin:end] = 1.0 / (end - begin)
    return matrix


@_register("relax.nn.adaptive_avg_pool2d")
def _adaptive_avg_pool2d_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                              ctx: relax.BlockBuilder) -> Partials:
    """y = A_h x A_w^T per (n, c) plane, A the per-axis averaging matrices, so
    dx = A_h^T dy A_w: two small matmuls with constants."""
    _require_layout(orig_call, "NCHW")
    x = orig_call.args[0]
    dtype = str(x.ty.dtype)
    h, w = _shape_of(x)[2:]
    out_h, out_w = _shape_of(orig_var)[2:]
    rows = relax.const(_adaptive_matrix(h, out_h, dtype).T.copy(), dtype)  # (H, out_h)
    cols = relax.const(_adaptive_matrix(w, out_w, dtype), dtype)  # (out_w, W)
    return [op.matmul(op.matmul(rows, output_grad), cols)]


@_register("relax.nn.group_norm")
def _group_norm_grad(orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Expr,
                     ctx: relax.BlockBuilder) -> Partials:
    """As layer_norm's gradient (gradients.py) over each (sample, group) viewed as one row
    (N, G, C/G * spatial): dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma;
    dgamma = sum(dy * xhat), dbeta = sum(dy) over all axes but the channel."""
    attrs = orig_call.attrs
    x, gamma, beta = orig_call.args
    shape = _shape_of(x)
    ndim = len(shape)
    channel_axis = int(attrs.channel_axis) % ndim
    if channel_axis != 1:
        raise NotImplementedError("the gradient of group_norm needs channels on axis 1")
    groups = int(attrs.num_groups)
    eps = float(attrs.epsilon)
    n, channels = shape[0], shape[1]
    grouped = [n, groups, -1]
    param_shape = [1, channels] + [1] * (ndim - 2)
    other_axes = [0] + list(range(2, ndim))
    xg = ctx.emit(op.reshape(x, grouped))
    mean = ctx.emit(op.mean(xg, [2], keepdims=True))
    centered = ctx.emit(op.subtract(xg, mean))
    var = ctx.emit(op.mean(op.multiply(centered, centered), [2], keepdims=True))
    rstd = ctx.emit(op.rsqrt(op.add(var, relax.const(eps, x.ty.dtype))))
    xhat = ctx.emit(op.reshape(op.multiply(centered, rstd), shape))
    partials = []
    scale = bool(attrs.scale)
    g = ctx.emit(op.multiply(output_grad, op.reshape(gamma, param_shape))) if scale \
        else output_grad
    gg = ctx.emit(op.reshape(g, grouped))
    xhat_g = op.reshape(xhat, grouped)
    mean_g = op.mean(gg, [2], keepdims=True)
    mean_gx = op.mean(op.multiply(gg, xhat_g), [2], keepdims=True)
    dx = op.multiply(rstd, op.subtract(op.subtract(gg, mean_g), op.multiply(xhat_g, mean_gx)))
    partials.append(op.reshape(dx, shape))
    partials.append(op.sum(op.multiply(output_grad, xhat), other_axes) if scale
                    else grad_ops.no_grad(gamma))
    partials.append(op.sum(output_grad, other_axes) if bool(attrs.center)
                    else grad_ops.no_grad(beta))
    return partials
