"""Gradient markers: the contract between the step builder and the distribution passes.

``g_marked = R.call_pure_packed("raf_dist.mark_gradient", g, R.prim_value(i), ty_args=g.ty)``
says "g is the gradient of parameter i; the optimizer reads g_marked". The builder places
each marker right after the binding that produces the gradient, so marker order is the order
in which backward produces gradients. Distribution passes replace the markers by collectives
(allreduce, reduce_scatter); StripGradientMarkers turns them into plain aliases. The layout
attributes below say which arguments are parameters and optimizer states, for passes that
change how those are held (ZeRO shards them).
"""
import dataclasses

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir.attrs import (LAYOUT_NUM_PARAMS, LAYOUT_PARAM_OFFSET, LAYOUT_STATES_PER_PARAM,
                        UPDATED_ARGUMENTS)
from ..ir.ops import MARK_GRADIENT, is_gradient_marker, mark_gradient
from ..ir.utils import mutate_functions, tensor_numel

__all__ = ["LAYOUT_NUM_PARAMS", "LAYOUT_PARAM_OFFSET", "LAYOUT_STATES_PER_PARAM",
           "MARK_GRADIENT", "UPDATED_ARGUMENTS", "Marker", "StripGradientMarkers",
           "SubstituteVars", "find_markers", "is_marker", "mark_gradient", "substitute",
           "tensor_numel"]

is_marker = is_gradient_marker


@dataclasses.dataclass
class Marker:
    var: relax.Var  # the marked gradient (what the optimizer reads)
    grad: relax.Expr  # the raw gradient
    param_index: int
    position: int  # index of the marker binding in its block

    @property
    def numel(self):
        return tensor_numel(self.var.ty)

    @property
    def nbytes(self):
        return self.numel * tvm.DataType(self.var.ty.dtype).bits // 8


def find_markers(block):
    """Markers of one binding block, in binding (= backward production) order."""
    return [Marker(b.var, b.value.args[1], int(b.value.args[2]), i)
            for i, b in enumerate(block.bindings) if is_marker(b.value)]


@mutator
class _Strip(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        return call.args[1] if is_marker(call) else call


@tvm.transform.module_pass(opt_level=0, name="StripGradientMarkers")
class StripGradientMarkers:
    """Replace every gradient marker by the gradient itself (no distribution)."""

    def transform_module(self, mod, ctx):
        return mutate_functions(mod, _Strip(mod))


@mutator
class SubstituteVars(PyExprMutator):
    """Replace variables by others (used when a pass splits a dataflow block and dataflow
    variables must become ordinary ones)."""

    def __init__(self, mapping):
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, var):
        return self.mapping.get(var, var)

    def visit_dataflow_var_(self, var):
        return self.mapping.get(var, var)


def substitute(expr, mapping):
    """``expr`` with the variables of ``mapping`` replaced (SubstituteVars)."""
    return SubstituteVars(mapping).visit_expr(expr)
