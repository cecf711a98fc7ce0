"""DispatchMatmulToBLAS: matmul to the host BLAS, transposes folded into the call.

Input: any Relax module before LegalizeOps.
Output: every ``R.matmul(a, b)`` on float32/float64 tensors of rank >= 2 whose result has the
operands' dtype becomes
    ``R.call_dps_packed("raf_dist.blas.matmul", (a', b', trans_a, trans_b), out_ty)``
where a ``permute_dims`` that only swaps the last two axes of an operand is folded into its
``trans_`` flag (a' is the un-transposed tensor). The permute_dims left unused are removed.
Forward and backward matmuls (the Gradient pass emits permute_dims + matmul) both dispatch.
The runtime function is ``raf_dist.runtime.blas.matmul``.
"""
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

BLAS_MATMUL = "raf_dist.blas.matmul"
_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_BLAS_DTYPES = ("float32", "float64")


def _is_last_two_swap(call):
    ndim = call.args[0].ty.ndim
    if call.attrs.axes is None:
        return ndim == 2  # default permutation reverses all axes
    axes = [int(a) for a in call.attrs.axes]
    return ndim >= 2 and axes == list(range(ndim - 2)) + [ndim - 1, ndim - 2]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)

    def _fold_transpose(self, operand):
        if isinstance(operand, relax.Var):
            bound = self.lookup_binding(operand)
            if isinstance(bound, relax.Call) and bound.op == _PERMUTE and _is_last_two_swap(bound):
                return bound.args[0], 1
        return operand, 0

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op != _MATMUL:
            return call
        a, b = call.args
        out = call.ty
        if (a.ty.dtype not in _BLAS_DTYPES or a.ty.dtype != b.ty.dtype
                or out.dtype != a.ty.dtype or a.ty.ndim < 2
                or b.ty.ndim < 2):
            return call
        a, trans_a = self._fold_transpose(a)
        b, trans_b = self._fold_transpose(b)
        return relax.call_dps_packed(
            BLAS_MATMUL, relax.Tuple([a, b, relax.prim_value(trans_a), relax.prim_value(trans_b)]), out)


@tvm.transform.module_pass(opt_level=0, name="DispatchMatmulToBLAS")
class DispatchMatmulToBLAS:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        rewriter = _Rewriter(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        mod = rewriter.builder_.get()
        entry = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
        return relax.transform.DeadCodeElimination(entry)(mod)
