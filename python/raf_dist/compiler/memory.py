"""Planned memory of a lowered module: what StaticPlanBlockMemory decided to allocate."""
import tvm
from tvm import relax

_ALLOC_STORAGE = tvm.ir.Op.get("relax.memory.alloc_storage")
_ALLOC_TENSOR = tvm.ir.Op.get("relax.builtin.alloc_tensor")


def _static_size(shape_expr):
    if not isinstance(shape_expr, relax.ShapeExpr):
        return None
    size = 1
    for dim in shape_expr.values:
        if not isinstance(dim, tvm.tirx.IntImm):
            return None
        size *= int(dim.value)
    return size


def planned_bytes(mod, func_name=None):
    """Bytes of storage the planned module allocates in one call of ``func_name`` (every Relax
    function when None): planned storage blocks plus tensors the planner left unplanned (the
    function's outputs). Run after StaticPlanBlockMemory."""
    total = 0

    def visit(expr):
        nonlocal total
        if not isinstance(expr, relax.Call):
            return
        if expr.op == _ALLOC_STORAGE:
            total += _static_size(expr.args[0]) or 0
        elif expr.op == _ALLOC_TENSOR:
            numel = _static_size(expr.args[0]) or 0
            dtype = tvm.DataType(expr.args[1].value)
            total += numel * ((dtype.bits + 7) // 8) * dtype.lanes

    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function) and func_name in (None, gvar.name_hint):
            relax.analysis.post_order_visit(func, visit)
    return total
