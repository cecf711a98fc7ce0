"""DropoutMasksAsInputs: dropout with seeded masks that the host supplies each step (applied by
the frontends when they capture a model).

The PyTorch frontend imports every dropout with rate p > 0 as a marker
``R.call_pure_packed("raf_dist.dropout", x, R.prim_value(i), ty_args=x.ty)`` (i: the i-th
dropout in execution order). This pass, on the ``forward`` function:
  input:  forward(*inputs, *params) with markers
  output: forward(*inputs, *masks, *params) where marker i became ``x * mask_i``
Each mask is an input of x's shape holding 0 or 1/(1-p) (inverted dropout, as PyTorch): the
Trainer draws it every step from a seeded generator (so runs are reproducible and checkable
against PyTorch given the same masks) and passes ones for inference. The gradient is the
ordinary gradient of multiply.
"""
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir.ops import DROPOUT_MARKER
from ..ir.utils import is_packed_marker

@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, masks):
        super().__init__()
        self.masks = masks

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if is_packed_marker(call, DROPOUT_MARKER):
            return relax.op.multiply(call.args[1], self.masks[int(call.args[2])])
        return call


def dropout_masks_as_inputs(func, num_inputs, mask_types):
    """Rewrite ``func`` (see the module docstring); ``mask_types[i]`` is marker i's type."""
    masks = [relax.Var(f"dropout_mask{i}", ty) for i, ty in enumerate(mask_types)]
    body = _Rewrite(masks).visit_expr(func.body)
    params = list(func.params[:num_inputs]) + masks + list(func.params[num_inputs:])
    return relax.Function(params, body, func.ret_ty, is_pure=func.is_pure, attrs=func.attrs)
