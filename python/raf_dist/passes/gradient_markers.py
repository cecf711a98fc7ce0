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

from .mutate import is_packed_marker, mutate_functions

MARK_GRADIENT = "raf_dist.mark_gradient"

# train_step's attributes saying where parameters and optimizer states sit among its
# arguments: (inputs..., target, params..., states (per parameter, in order)..., scalars...)
LAYOUT_PARAM_OFFSET = "raf_dist.param_offset"  # index of the first parameter argument
LAYOUT_NUM_PARAMS = "raf_dist.num_params"
LAYOUT_STATES_PER_PARAM = "raf_dist.states_per_param"
# output field 1 + i of train_step is the new value of argument UPDATED_ARGUMENTS[i] (the
# parameters, then the optimizer states): compiler.UpdateInPlace makes the step write it into
# that argument's buffer
UPDATED_ARGUMENTS = "raf_dist.updated_arguments"


def mark_gradient(grad, param_index):
    return relax.call_pure_packed(MARK_GRADIENT, grad, relax.prim_value(int(param_index)),
                                  ty_args=grad.ty)


def is_marker(expr):
    return is_packed_marker(expr, MARK_GRADIENT)


def tensor_numel(ty):
    """Element count of a statically shaped TensorType."""
    n = 1
    for d in ty.shape:
        n *= int(d)
    return n


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
