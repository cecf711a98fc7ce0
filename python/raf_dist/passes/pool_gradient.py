"""MaxPoolGradient: max_pool2d's gradient from single-value reductions.

Input: a module before LegalizeOps (the training step after TVM's Gradient pass).
Output: every ``R.grad.max_pool2d_backward(dy, x)`` on NCHW float tensors with dilation 1
becomes three TE stages: the window maximum, the window-local index of its first occurrence
(row-major, PyTorch's and TVM's tie rule) and, per input element, the sum of ``dy`` over the
windows whose first maximum it is.

Why: TVM 0.27 legalizes this op as an argmax over a (flat int64 index, value) tuple reduction,
which on the GPU gives wrong gradients (measured on an H100, 2x2/2 pooling of (8,4,8,8):
258 of 2048 elements wrong; the same kernel is right on the CPU, the cause inside TVM's GPU
lowering was not found). Max and min reductions over float32 are the kind every backend and
dlight rule handles. The local index is a small integer, exact in float32.
"""
import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir.utils import mutate_functions

_MAX_POOL2D_BACKWARD = tvm.ir.Op.get("relax.grad.max_pool2d_backward")


def _max_pool2d_backward(dy, x, pool_size, strides, padding):
    """Gradient of max_pool2d (NCHW, dilation 1) w.r.t. its input, as TE stages."""
    (kh, kw), (sh, sw) = pool_size, strides
    pad_top, pad_left = padding[0], padding[1]
    n, c, height, width = x.shape
    out_h, out_w = dy.shape[2], dy.shape[3]
    lowest = tvm.tirx.const(float("-inf"), x.dtype)

    def window_value(b, ch, oh, ow, i, j):
        y, z = oh * sh - pad_top + i, ow * sw - pad_left + j
        inside = tvm.tirx.all(y >= 0, y < height, z >= 0, z < width)
        return te.if_then_else(inside, x[b, ch, te.max(te.min(y, height - 1), 0),
                                         te.max(te.min(z, width - 1), 0)], lowest)

    ri, rj = te.reduce_axis((0, kh), "ri"), te.reduce_axis((0, kw), "rj")
    window_max = te.compute(
        dy.shape, lambda b, ch, oh, ow: te.max(window_value(b, ch, oh, ow, ri, rj), axis=[ri, rj]),
        name="pool_window_max")
    fi, fj = te.reduce_axis((0, kh), "fi"), te.reduce_axis((0, kw), "fj")
    none = tvm.tirx.const(float(kh * kw), "float32")  # larger than every local index
    first = te.compute(
        dy.shape, lambda b, ch, oh, ow: te.min(te.if_then_else(
            window_value(b, ch, oh, ow, fi, fj) == window_max[b, ch, oh, ow],
            (fi * kw + fj).astype("float32"), none), axis=[fi, fj]),
        name="pool_window_first_max")

    # input row y lies in windows oh = (y + pad) // s - k' for k' in [0, ceil(k / s))
    wh = te.reduce_axis((0, (kh + sh - 1) // sh), "wh")
    ww = te.reduce_axis((0, (kw + sw - 1) // sw), "ww")

    def gradient(b, ch, y, z):
        oh, ow = (y + pad_top) // sh - wh, (z + pad_left) // sw - ww
        local_y, local_x = y + pad_top - oh * sh, z + pad_left - ow * sw
        valid = tvm.tirx.all(oh >= 0, oh < out_h, ow >= 0, ow < out_w, local_y < kh, local_x < kw)
        ohc, owc = te.max(te.min(oh, out_h - 1), 0), te.max(te.min(ow, out_w - 1), 0)
        is_first = first[b, ch, ohc, owc] == (local_y * kw + local_x).astype("float32")
        return te.sum(te.if_then_else(tvm.tirx.all(valid, is_first), dy[b, ch, ohc, owc],
                                      tvm.tirx.const(0, dy.dtype)), axis=[wh, ww])

    return te.compute(x.shape, gradient, name="max_pool2d_backward")


@mutator
class _Rewrite(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op != _MAX_POOL2D_BACKWARD:
            return call
        attrs = call.attrs
        if (attrs.layout != "NCHW" or any(int(d) != 1 for d in attrs.dilation)
                or call.args[1].ty.dtype not in ("float16", "float32", "float64")):
            return call  # TVM's own legalization (its dilation-1, NCHW limits are ours too)
        return self.builder_.call_te(
            _max_pool2d_backward, call.args[0], call.args[1],
            [int(v) for v in attrs.pool_size], [int(v) for v in attrs.strides],
            [int(v) for v in attrs.padding], primfunc_name_hint="max_pool2d_backward")


@tvm.transform.module_pass(opt_level=0, name="MaxPoolGradient")
class MaxPoolGradient:
    """See the module docstring."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        return mutate_functions(mod, _Rewrite(mod))
