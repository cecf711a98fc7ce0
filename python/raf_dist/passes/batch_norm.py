"""DecomposeBatchNorm: training-mode batch norm as primitive ops, optionally synchronized.

Input: a module whose functions may contain ``R.nn.batch_norm(x, gamma, beta, running_mean,
running_var, training=True)`` as the PyTorch frontend imports it (frontend/buffers.py): its
outputs are (y, new running mean, new running var) with PyTorch's train-mode semantics.
Runs on the forward, before autodiff (relax.nn.batch_norm has no gradient in TVM 0.27, and its
legalization updates the running variance with the biased variance).
Argument: ``sync_world_size`` W. With W > 1 the batch statistics are those of the global
batch across W data-parallel ranks (SyncBatchNorm): the per-channel sum and, in a second pass,
the sum of squared deviations from the global mean are summed across ranks with
``R.ccl.allreduce`` (an op whose gradient, registered here, is the allreduce of the output
gradient), and counts are multiplied by W. The global two-pass variance equals one process's
on the global batch up to reduction order.
Output, per batch norm over reduction axes of n elements per channel (N = n * W)::

    mean = sum(x) / N            centered = x - mean
    var = sum(centered^2) / N    y = centered * rsqrt(var + eps) * gamma + beta
    new_running_mean = (1 - m) * running_mean + m * mean
    new_running_var = (1 - m) * running_var + m * var * N / (N - 1)     (unbiased, as PyTorch)

Inference-mode batch norm (training=False) is left alone (TVM legalizes it with the running
statistics). The lowering of ``R.ccl.allreduce`` to the runtime is ``LowerAllReduce``.
"""
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.op.base import register_gradient

from ..ir.utils import mutate_functions

_BATCH_NORM = tvm.ir.Op.get("relax.nn.batch_norm")
_ALLREDUCE = tvm.ir.Op.get("relax.ccl.allreduce")
op = relax.op


def _allreduce_grad(orig_var, orig_call, output_grad, ctx):
    """y = sum_r x_r on every rank: dL/dx_r = sum_r' dL_r'/dy, the allreduce of the output
    gradient (Megatron's reduce-from-parallel-region backward, mirrored)."""
    op_type = str(orig_call.attrs.op_type)
    if op_type not in ("sum", "avg"):
        raise NotImplementedError(f"no gradient for allreduce({op_type}); only sum and avg")
    return [relax.op.ccl.allreduce(output_grad, op_type, bool(orig_call.attrs.in_group))]


if _ALLREDUCE.get_attr("FPrimalGradient") is None:
    register_gradient("relax.ccl.allreduce", _allreduce_grad, level=11)


def _const(value, dtype):
    return relax.const(value, dtype)


@mutator
class _Decompose(PyExprMutator):
    def __init__(self, mod, world_size):
        super().__init__(mod)
        self.world_size = world_size

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op != _BATCH_NORM or not bool(call.attrs.training):
            return call
        return self._decompose(call)

    def _decompose(self, call):
        emit = self.builder_.emit
        x, gamma, beta, running_mean, running_var = call.args
        attrs = call.attrs
        shape = [int(d) for d in x.ty.shape]
        ndim = len(shape)
        axis = int(attrs.axis) % ndim
        axes = [i for i in range(ndim) if i != axis]
        channels = shape[axis]
        dtype = str(x.ty.dtype)
        count = self.world_size
        for i in axes:
            count *= shape[i]
        if count < 2:
            raise ValueError(f"batch norm over {count} value per channel in training mode: the "
                             "unbiased variance is undefined (PyTorch refuses it too); use a "
                             "batch of at least 2 rows")
        per_channel = [1] * ndim
        per_channel[axis] = channels

        def total(value):
            summed = emit(op.sum(value, axes, keepdims=True))
            if self.world_size > 1:
                summed = emit(op.ccl.allreduce(summed, "sum", True))
            return summed

        mean = emit(op.divide(total(x), _const(float(count), dtype)))
        centered = emit(op.subtract(x, mean))
        var = emit(op.divide(total(emit(op.multiply(centered, centered))),
                             _const(float(count), dtype)))
        rstd = emit(op.rsqrt(emit(op.add(var, _const(float(attrs.epsilon), dtype)))))
        y = emit(op.multiply(centered, rstd))
        if bool(attrs.scale):
            y = emit(op.multiply(y, emit(op.reshape(gamma, per_channel))))
        if bool(attrs.center):
            y = emit(op.add(y, emit(op.reshape(beta, per_channel))))
        momentum = float(attrs.momentum)
        batch_mean = emit(op.reshape(mean, [channels]))
        batch_var = emit(op.multiply(emit(op.reshape(var, [channels])),
                                     _const(count / (count - 1.0), dtype)))

        def blend(running, batch):
            if momentum == 1.0:
                return batch
            return emit(op.add(emit(op.multiply(running, _const(1.0 - momentum, dtype))),
                               emit(op.multiply(batch, _const(momentum, dtype)))))

        return relax.Tuple([y, blend(running_mean, batch_mean), blend(running_var, batch_var)])


def has_training_batch_norm(mod: tvm.IRModule) -> bool:
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op == _BATCH_NORM and bool(expr.attrs.training):
            found.append(expr)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="DecomposeBatchNorm")
class DecomposeBatchNorm:
    """See the module docstring."""

    def __init__(self, sync_world_size: int = 1):
        if int(sync_world_size) < 1:
            raise ValueError(f"sync_world_size must be >= 1, got {sync_world_size}")
        self.sync_world_size = int(sync_world_size)

    def transform_module(self, mod, ctx):
        if not has_training_batch_norm(mod):
            return mod
        return mutate_functions(mod, _Decompose(mod, self.sync_world_size))


def decompose_forward(model, sync_world_size: int = 1):
    """``model`` (a raf_dist Model) with the training batch norms of its forward decomposed,
    synchronized over ``sync_world_size`` ranks; the evaluation forward is left as it is."""
    import dataclasses

    functions = dict(model.mod.functions_items())
    forward_gvar = model.mod.get_global_var("forward")
    decomposed = DecomposeBatchNorm(sync_world_size)(
        tvm.IRModule({forward_gvar: functions[forward_gvar]}))
    functions[forward_gvar] = decomposed[forward_gvar]
    return dataclasses.replace(model, mod=tvm.IRModule(functions))
