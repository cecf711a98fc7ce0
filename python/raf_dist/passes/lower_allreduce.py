"""LowerAllReduce: ``R.ccl.allreduce`` ops (forward collectives with a gradient, e.g.
synchronized batch norm's statistics and their backward) become raf_dist runtime calls.

Input: any module (runs after autodiff and after the distribution pass, which may already
have split ``train_step`` into several blocks). Argument: ``group``, the native process-group
id of the data-parallel ranks (the same on every rank: the IR stays SPMD).
Output: each ``y = R.ccl.allreduce(x, op)`` becomes ``y = alloc_tensor(shape of x)`` and a
blocking impure ``R.call_packed("raf_dist.ccl.allreduce", x, op, group, y)``: impure, so no
pass drops or reorders it; blocking, so no buffer is in flight when the memory planner runs
(DESIGN.md section 5). TVM's own lowering targets ``runtime.disco.*``, which works only inside
a Disco session. The dataflow block is split around each call.
"""
import tvm
from tvm import relax

from .bucketing import Segments, assemble, collective

_ALLREDUCE = tvm.ir.Op.get("relax.ccl.allreduce")


def lower_allreduce_op(func, group, op=_ALLREDUCE, op_type=None):
    """``func`` with every ``op`` call (one tensor in, its allreduce out; ``op_type``, else
    the call's attribute, else a sum) lowered as the module docstring says."""
    seg = Segments()
    found = False
    for block in func.body.blocks:
        dataflow = isinstance(block, relax.DataflowBlock)
        for binding in block.bindings:
            value = binding.value
            if not (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)
                    and value.op == op):
                seg.add(binding, dataflow)
                continue
            found = True
            x = value.args[0]
            seg.add(relax.VarBinding(binding.var, relax.op.builtin.alloc_tensor(
                relax.ShapeExpr([int(d) for d in x.ty.shape]), str(x.ty.dtype), relax.prim_value(0))), dataflow)
            seg.bind(f"{binding.var.name}_allreduce", collective(
                "raf_dist.ccl.allreduce", x, tvm.ir.StringImm(
                    op_type or (str(value.attrs.op_type) if value.attrs is not None else "sum")),
                relax.prim_value(group), binding.var), dataflow=False)
    if not found:
        return func
    return assemble(func, seg.segments, func.body.body)


@tvm.transform.module_pass(opt_level=0, name="LowerAllReduce")
class LowerAllReduce:
    """See the module docstring."""

    def __init__(self, group: int = 0):
        self.group = int(group)

    def transform_module(self, mod, ctx):
        updates = {gvar: lower_allreduce_op(func, self.group) for gvar, func in mod.functions_items()
                   if isinstance(func, relax.Function)}
        mod = mod.__class__(dict(mod.functions_items()))
        for gvar, func in updates.items():
            mod[gvar] = func
        return relax.transform.Normalize()(mod)
