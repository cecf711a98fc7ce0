"""Megatron's two tensor-parallel region boundaries as Relax ops (DESIGN.md section 3b).

- ``raf_dist.tp_copy`` (Megatron's f, ``copy_to_tensor_model_parallel_region``): identity
  forward; its gradient is ``tp_reduce`` of the output gradient, i.e. the gradients that the
  tensor-parallel ranks computed for their slices of the region are summed.
- ``raf_dist.tp_reduce`` (Megatron's g, ``reduce_from_tensor_model_parallel_region``): the
  allreduce (sum) over the tp group forward; identity backward (every rank already holds the
  same output gradient: the region's result is replicated).

Two more serve the vocabulary-parallel embedding and cross-entropy:
- ``raf_dist.tp_max``: the allreduce (max) over the tp group, no gradient (the softmax's
  shift, a constant for autodiff as in Megatron's ``_VocabParallelCrossEntropy``);
- ``raf_dist.tp_rank(x)``: this rank's position in the tp group as a 0-d int64 tensor on x's
  device. Which vocabulary rows a rank holds is read at run time, so the IR stays the same on
  every rank (DESIGN.md section 2).

They are registered from Python (op, type inference, purity, gradient), so the
tensor-parallel pass inserts them in the forward graph *before* autodiff and TVM's Gradient
pass emits the backward collectives by itself. After autodiff ``LowerTensorParallel(group)``
removes the copies, lowers each reduce (and max) to a blocking ``raf_dist.ccl.allreduce`` on
the tp group (passes/lower_allreduce.py) and each tp_rank to a runtime call.
"""
import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir import _ffi_api as _ir_api
from tvm.relax.op.base import register_gradient

from .lower_allreduce import lower_allreduce_op
from .mutate import mutate_functions

TP_COPY = "raf_dist.tp_copy"
TP_REDUCE = "raf_dist.tp_reduce"
TP_MAX = "raf_dist.tp_max"
TP_RANK = "raf_dist.tp_rank"
_RANK_FUNC = "raf_dist.tp_rank_tensor"


def _register(name, description, infer=lambda call, ctx: call.args[0].ty):
    if name in _ir_api.ListOpNames():  # registered already (module reloaded)
        return tvm.ir.Op.get(name)
    _ir_api.RegisterOp(name, description)
    op = tvm.ir.Op.get(name)
    op.set_num_inputs(1)
    op.add_argument("x", "Tensor", "the tensor")
    tvm.ir.register_op_attr(name, "FInferType", infer)
    tvm.ir.register_op_attr(name, "FPurity", True)
    tvm.ir.register_op_attr(name, "TScriptPrinterName", name)
    return op


_COPY = _register(TP_COPY, "identity forward, allreduce(sum) over the tp group backward")
_REDUCE = _register(TP_REDUCE, "allreduce(sum) over the tp group forward, identity backward")
register_gradient(TP_COPY, lambda var, call, grad, ctx: [relax.Call(_REDUCE, [grad])], level=11)
register_gradient(TP_REDUCE, lambda var, call, grad, ctx: [grad], level=11)
_MAX = _register(TP_MAX, "allreduce(max) over the tp group forward, no gradient")
register_gradient(TP_MAX, lambda var, call, grad, ctx: [relax.op.zeros_like(grad)], level=11)
_RANK = _register(TP_RANK, "this rank's index in the tp group (0-d int64)",
                  infer=lambda call, ctx: relax.TensorType((), "int64"))
register_gradient(TP_RANK, lambda var, call, grad, ctx: [relax.op.zeros_like(call.args[0])],
                  level=11)


def _rank_tensor(like, group):
    """``raf_dist.tp_rank_tensor(like, group)``: the group rank as a 0-d int64 tensor on
    ``like``'s device (a Python callback, a few microseconds: once per step)."""
    from .. import _native

    return tvm.runtime.tensor(np.array(_native.func("group_rank")(int(group)), dtype="int64"),
                              device=like.device)


tvm_ffi.register_global_func(_RANK_FUNC, _rank_tensor, override=True)


def tp_copy(x):
    """f: the replicated input ``x`` of a tensor-parallel region."""
    return relax.Call(_COPY, [x])


def tp_reduce(x):
    """g: the sum over the tp ranks of their partial results ``x``."""
    return relax.Call(_REDUCE, [x])


def tp_max(x):
    """The elementwise max over the tp ranks of ``x`` (no gradient)."""
    return relax.Call(_MAX, [x])


def tp_rank(like):
    """This rank's index in the tp group, a 0-d int64 tensor on ``like``'s device."""
    return relax.Call(_RANK, [like])


def is_tp_op(expr, which=None):
    ops = (_COPY, _REDUCE, _MAX, _RANK) if which is None else (tvm.ir.Op.get(which),)
    return isinstance(expr, relax.Call) and any(expr.op.same_as(op) for op in ops)


@relax.expr_functor.mutator
class _StripCopies(relax.expr_functor.PyExprMutator):
    """tp_copy(x) -> x; tp_rank(x) -> the runtime's answer for ``group``."""

    def __init__(self, mod, group):
        super().__init__(mod)
        self.group = group

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if is_tp_op(call, TP_COPY):
            return call.args[0]
        if is_tp_op(call, TP_RANK):
            return relax.call_pure_packed(_RANK_FUNC, call.args[0], relax.prim_value(self.group),
                                          ty_args=relax.TensorType((), "int64"))
        return call


@tvm.transform.module_pass(opt_level=0, name="LowerTensorParallel")
class LowerTensorParallel:
    """After autodiff: ``tp_copy(x)`` becomes ``x``; ``tp_reduce(x)`` a blocking allreduce
    (sum) over native process group ``group`` (the tp axis of the mesh; the same id on every
    rank, so the IR stays SPMD)."""

    def __init__(self, group: int):
        self.group = int(group)

    def transform_module(self, mod, ctx):
        mod = mutate_functions(mod, _StripCopies(mod, self.group))
        updates = {gvar: lower_allreduce_op(lower_allreduce_op(func, self.group, _REDUCE),
                                            self.group, _MAX, "max")
                   for gvar, func in mod.functions_items() if isinstance(func, relax.Function)}
        mod = mod.__class__(dict(mod.functions_items()))
        for gvar, func in updates.items():
            mod[gvar] = func
        return relax.transform.Normalize()(mod)
