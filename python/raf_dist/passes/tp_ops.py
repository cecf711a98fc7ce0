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
import tvm
from tvm import relax

from ..ir.ops import (TP_COPY, TP_MAX, TP_RANK, TP_RANK_FUNC, TP_REDUCE, is_tp_op, tp_copy,
                      tp_max, tp_rank, tp_reduce)
from ..ir.utils import mutate_functions
from .lower_allreduce import lower_allreduce_op, lower_functions

__all__ = ["LowerTensorParallel", "TP_COPY", "TP_MAX", "TP_RANK", "TP_REDUCE", "is_tp_op",
           "tp_copy", "tp_max", "tp_rank", "tp_reduce"]


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
            return relax.call_pure_packed(TP_RANK_FUNC, call.args[0],
                                          relax.prim_value(self.group),
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
        return lower_functions(mod, lambda func: lower_allreduce_op(
            lower_allreduce_op(func, self.group, tvm.ir.Op.get(TP_REDUCE)),
            self.group, tvm.ir.Op.get(TP_MAX), "max"))
