"""PropagateNaN: relu, maximum, minimum and clip return NaN for a NaN input, as in PyTorch.

Why: TVM 0.27 lowers these ops to TIR ``max``/``min``, which the LLVM backend emits as a
compare-and-select that returns the other operand when one is NaN (measured on the CPU:
``relu(nan) = 0``, ``maximum(nan, 0) = 0``, ``clip(nan, -1, 1) = 1``). A NaN input then
vanished at the first ReLU: the loss came back finite while the weight gradient of the first
layer (input x upstream gradient) was NaN, and the weights silently became NaN.

Input: a Relax module (a training step after autodiff, or a forward). Output: every float
``R.nn.relu(x)`` becomes ``R.where(R.isnan(x), x, R.nn.relu(x))``, ``R.maximum(a, b)`` /
``R.minimum(a, b)`` become ``R.where(R.isnan(a) | R.isnan(b), a + b, R.maximum(a, b))``
(a + b is NaN there) and ``R.clip(x, lo, hi)`` ``R.where(R.isnan(x), x, R.clip(x, lo, hi))``.
The selects fuse with the op into one elementwise kernel. Gradients are unchanged (the pass
runs after Gradient; NaN reaching the loss makes every gradient NaN anyway).

Not covered: max/min *reductions* (a NaN in a row is dropped by the reduction itself).
Softmax and log-softmax still return NaN (the NaN element's ``x - max`` is NaN and so is the
row's sum of exponentials); max pooling drops a NaN in its window (the Trainer's non-finite
check still sees the NaN weight gradient).
"""
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir.utils import mutate_functions

_RELU = tvm.ir.Op.get("relax.nn.relu")
_MAXIMUM = tvm.ir.Op.get("relax.maximum")
_MINIMUM = tvm.ir.Op.get("relax.minimum")
_CLIP = tvm.ir.Op.get("relax.clip")


def _is_float(expr):
    ty = expr.ty
    return isinstance(ty, relax.TensorType) and str(ty.dtype).startswith(("float", "bfloat"))


def _isnan(x, emit):
    """isnan(x); TIR has no isnan for 16-bit floats, so those are widened first (the cast
    fuses into the same kernel)."""
    if str(x.ty.dtype) in ("bfloat16", "float16"):
        x = emit(relax.op.astype(x, "float32"))
    return relax.op.isnan(x)


@mutator
class _Rewrite(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op not in (_RELU, _MAXIMUM, _MINIMUM, _CLIP) or not _is_float(call.args[0]):
            return call
        emit, op = self.builder_.emit, relax.op
        if call.op in (_MAXIMUM, _MINIMUM):
            a, b = call.args
            nan = emit(op.logical_or(emit(_isnan(a, emit)), emit(_isnan(b, emit))))
            return op.where(nan, emit(op.add(a, b)), emit(call))
        x = call.args[0]
        return op.where(emit(_isnan(x, emit)), x, emit(call))


@tvm.transform.module_pass(opt_level=0, name="PropagateNaN")
class PropagateNaN:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        return mutate_functions(mod, _Rewrite(mod))
