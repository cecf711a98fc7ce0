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


def lower_blocking(func, matches, call, name):
    """``func`` with every binding ``y = value`` where ``matches(value)`` replaced by ``y =
    alloc_tensor(y's type)`` and the blocking impure packed call ``call(value, y)`` (named
    ``<y>_<name>``) that fills it: the lowering every raf_dist collective op gets (this
    module's allreduce, tp_ops.py's, embedding_parallel.py's exchanges). The dataflow block
    is split around each call."""
    seg = Segments()
    found = False
    for block in func.body.blocks:
        dataflow = isinstance(block, relax.DataflowBlock)
        for binding in block.bindings:
            value = binding.value
            if not (isinstance(binding, relax.VarBinding) and matches(value)):
                seg.add(binding, dataflow)
                continue
            found = True
            out = binding.var.ty
            seg.add(relax.VarBinding(binding.var, relax.op.builtin.alloc_tensor(
                relax.ShapeExpr([int(d) for d in out.shape]), str(out.dtype),
                relax.prim_value(0))), dataflow)
            seg.bind(f"{binding.var.name}_{name}", call(value, binding.var), dataflow=False)
    if not found:
        return func
    return assemble(func, seg.segments, func.body.body)


def lower_functions(mod, lower):
    """``mod`` with ``lower(func)`` in place of each Relax function, normalized."""
    updates = {gvar: lower(func) for gvar, func in mod.functions_items()
               if isinstance(func, relax.Function)}
    mod = mod.__class__(dict(mod.functions_items()))
    for gvar, func in updates.items():
        mod[gvar] = func
    return relax.transform.Normalize()(mod)


def lower_allreduce_op(func, group, op=_ALLREDUCE, op_type=None):
    """``func`` with every ``op`` call (one tensor in, its allreduce out; ``op_type``, else
    the call's attribute, else a sum) lowered as the module docstring says."""
    def allreduce(value, out):
        kind = op_type or (str(value.attrs.op_type) if value.attrs is not None else "sum")
        return collective("raf_dist.ccl.allreduce", value.args[0], tvm.ir.StringImm(kind),
                          relax.prim_value(group), out)

    return lower_blocking(func, lambda value: isinstance(value, relax.Call) and value.op == op,
                          allreduce, "allreduce")


@tvm.transform.module_pass(opt_level=0, name="LowerAllReduce")
class LowerAllReduce:
    """See the module docstring."""

    def __init__(self, group: int = 0):
        self.group = int(group)

    def transform_module(self, mod, ctx):
        return lower_functions(mod, lambda func: lower_allreduce_op(func, self.group))
