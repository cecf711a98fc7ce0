"""Megatron's two tensor-parallel region boundaries as Relax ops (DESIGN.md section 3b).

- ``raf_dist.tp_copy`` (Megatron's f, ``copy_to_tensor_model_parallel_region``): identity
  forward; its gradient is ``tp_reduce`` of the output gradient, i.e. the gradients that the
  tensor-parallel ranks computed for their slices of the region are summed.
- ``raf_dist.tp_reduce`` (Megatron's g, ``reduce_from_tensor_model_parallel_region``): the
  allreduce (sum) over the tp group forward; identity backward (every rank already holds the
  same output gradient: the region's result is replicated).

They are registered from Python (op, type inference = the input's type, purity, gradient), so
the tensor-parallel pass inserts them in the forward graph *before* autodiff and TVM's
Gradient pass emits the backward collectives by itself. After autodiff
``LowerTensorParallel(group)`` removes the copies and lowers each reduce to a blocking
``raf_dist.ccl.allreduce`` on the tp group (passes/lower_allreduce.py).
"""
import tvm
from tvm import relax
from tvm.ir import _ffi_api as _ir_api
from tvm.relax.op.base import register_gradient

from .lower_allreduce import lower_allreduce_op
from .mutate import mutate_functions

TP_COPY = "raf_dist.tp_copy"
TP_REDUCE = "raf_dist.tp_reduce"


def _register(name, description):
    if name in _ir_api.ListOpNames():  # registered already (module reloaded)
        return tvm.ir.Op.get(name)
    _ir_api.RegisterOp(name, description)
    op = tvm.ir.Op.get(name)
    op.set_num_inputs(1)
    op.add_argument("x", "Tensor", "the tensor")
    tvm.ir.register_op_attr(name, "FInferType", lambda call, ctx: call.args[0].ty)
    tvm.ir.register_op_attr(name, "FPurity", True)
    tvm.ir.register_op_attr(name, "TScriptPrinterName", name)
    return op


_COPY = _register(TP_COPY, "identity forward, allreduce(sum) over the tp group backward")
_REDUCE = _register(TP_REDUCE, "allreduce(sum) over the tp group forward, identity backward")
register_gradient(TP_COPY, lambda var, call, grad, ctx: [relax.Call(_REDUCE, [grad])], level=11)
register_gradient(TP_REDUCE, lambda var, call, grad, ctx: [grad], level=11)


def tp_copy(x):
    """f: the replicated input ``x`` of a tensor-parallel region."""
    return relax.Call(_COPY, [x])


def tp_reduce(x):
    """g: the sum over the tp ranks of their partial results ``x``."""
    return relax.Call(_REDUCE, [x])


def is_tp_op(expr, which=None):
    ops = (_COPY, _REDUCE) if which is None else (tvm.ir.Op.get(which),)
    return isinstance(expr, relax.Call) and any(expr.op.same_as(op) for op in ops)


@relax.expr_functor.mutator
class _StripCopies(relax.expr_functor.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        return call.args[0] if is_tp_op(call, TP_COPY) else call


@tvm.transform.module_pass(opt_level=0, name="LowerTensorParallel")
class LowerTensorParallel:
    """After autodiff: ``tp_copy(x)`` becomes ``x``; ``tp_reduce(x)`` a blocking allreduce
    (sum) over native process group ``group`` (the tp axis of the mesh; the same id on every
    rank, so the IR stays SPMD)."""

    def __init__(self, group: int):
        self.group = int(group)

    def transform_module(self, mod, ctx):
        mod = mutate_functions(mod, _StripCopies(mod))
        updates = {gvar: lower_allreduce_op(func, self.group, _REDUCE)
                   for gvar, func in mod.functions_items() if isinstance(func, relax.Function)}
        mod = mod.__class__(dict(mod.functions_items()))
        for gvar, func in updates.items():
            mod[gvar] = func
        return relax.transform.Normalize()(mod)
