"""DispatchToBLAS: matmul and convolution to the host BLAS (numpy), instead of TVM's
untuned loops.

Input: any Relax module before LegalizeOps.
Output, for float32/float64 operands whose result has the operands' dtype:
  - ``R.matmul(a, b)`` with both ranks >= 2 becomes
    ``R.call_dps_packed("raf_dist.blas.matmul", (a', b', trans_a, trans_b), out_ty)``, a
    ``permute_dims`` that only swaps the last two axes of an operand folded into its flag (a'
    is the un-transposed tensor); permute_dims left unused are removed. The Gradient pass
    emits permute_dims + matmul, so backward matmuls dispatch too.
  - ``R.nn.conv2d`` (groups 1) becomes ``raf_dist.blas.conv2d`` (im2col + GEMM) and
    ``R.nn.conv2d_transpose`` (groups 1, the data gradient of conv2d) becomes
    ``raf_dist.blas.conv2d_transpose`` (GEMM + col2im); strides, padding, dilation
    (output_padding) are passed as shapes and the three layouts as one string, so the
    CNHW/IOHW convolution the weight gradient uses dispatches as well.
The runtime functions are in ``raf_dist.runtime.blas``.
"""
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir.utils import mutate_functions

BLAS_MATMUL = "raf_dist.blas.matmul"
BLAS_CONV2D = "raf_dist.blas.conv2d"
BLAS_CONV2D_TRANSPOSE = "raf_dist.blas.conv2d_transpose"
_MATMUL = tvm.ir.Op.get("relax.matmul")
_CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
_CONV2D_TRANSPOSE = tvm.ir.Op.get("relax.nn.conv2d_transpose")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_BLAS_DTYPES = ("float32", "float64")
# matmul also in 16 bits (runtime/blas.py: oneDNN through torch, accumulated in float32);
# convolutions in 16 bits stay TVM's (AccumulateInFloat32 keeps their sums in float32)
_MATMUL_DTYPES = _BLAS_DTYPES + ("bfloat16", "float16")


def blas_operands(call, bound):
    """(a, trans_a, b, trans_b) as ``raf_dist.blas.matmul`` gets ``call``'s operands: a
    ``permute_dims`` swapping the last two axes (``bound(var)``: the value a variable is
    bound to) folded into a flag; None when the matmul stays TVM's."""
    a, b = call.args
    out = call.ty
    if (a.ty.dtype not in _MATMUL_DTYPES or a.ty.dtype != b.ty.dtype
            or out.dtype != a.ty.dtype or a.ty.ndim < 2 or b.ty.ndim < 2):
        return None

    def fold(operand):
        value = bound(operand) if isinstance(operand, relax.Var) else None
        if isinstance(value, relax.Call) and value.op == _PERMUTE and is_last_two_swap(value):
            return value.args[0], 1
        return operand, 0

    return (*fold(a), *fold(b))


def is_last_two_swap(call):
    ndim = call.args[0].ty.ndim
    if call.attrs.axes is None:
        return ndim == 2  # default permutation reverses all axes
    axes = [int(a) for a in call.attrs.axes]
    return ndim >= 2 and axes == list(range(ndim - 2)) + [ndim - 1, ndim - 2]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op in (_CONV2D, _CONV2D_TRANSPOSE):
            return self._conv(call)
        if call.op != _MATMUL:
            return call
        operands = blas_operands(call, self.lookup_binding)
        if operands is None:
            return call
        a, trans_a, b, trans_b = operands
        return relax.call_dps_packed(
            BLAS_MATMUL, relax.Tuple([a, b, relax.prim_value(trans_a), relax.prim_value(trans_b)]),
            call.ty)

    def _conv(self, call):
        data, weight = call.args
        attrs = call.attrs
        dtype = data.ty.dtype
        if (int(attrs.groups) != 1 or dtype not in _BLAS_DTYPES or weight.ty.dtype != dtype
                or call.ty.dtype != dtype or data.ty.ndim != 4):
            return call
        layouts = f"{attrs.data_layout},{attrs.kernel_layout},{attrs.out_layout}"
        geometry = [relax.ShapeExpr([int(v) for v in attrs.strides]),
                    relax.ShapeExpr([int(v) for v in attrs.padding])]
        if call.op == _CONV2D_TRANSPOSE:
            geometry.append(relax.ShapeExpr([int(v) for v in attrs.output_padding]))
        geometry.append(relax.ShapeExpr([int(v) for v in attrs.dilation]))
        name = BLAS_CONV2D if call.op == _CONV2D else BLAS_CONV2D_TRANSPOSE
        return relax.call_dps_packed(
            name, relax.Tuple([data, weight, *geometry, tvm.ir.StringImm(layouts)]), call.ty)


@tvm.transform.module_pass(opt_level=0, name="DispatchToBLAS")
class DispatchToBLAS:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        mod = mutate_functions(mod, _Rewriter(mod))
        entry = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
        return relax.transform.DeadCodeElimination(entry)(mod)
