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


_ALLOC_TENSOR_IN_STORAGE = tvm.ir.Op.get("relax.memory.alloc_tensor")


def inflight_storage_conflicts(func):
    """Allocations the memory planner placed on the storage of a buffer that an asynchronous
    collective is still writing (between ``raf_dist.ccl.*_start`` and its ``wait``): the
    silent corruption DESIGN.md section 5 describes. Run on a function after
    StaticPlanBlockMemory; returns [(start binding, conflicting binding)] (empty when safe)."""
    storage_of = {}  # tensor var -> storage var, through aliases
    bindings = [b for block in func.body.blocks for b in block.bindings]
    in_flight = {}  # handle var -> (storages the collective reads or writes, start binding name)
    conflicts = []
    for binding in bindings:
        value = binding.value
        if isinstance(value, relax.Call) and value.op == _ALLOC_TENSOR_IN_STORAGE:
            storage = value.args[0]
            storage_of[binding.var] = storage
            for busy, start in in_flight.values():
                if any(b.same_as(storage) for b in busy):
                    conflicts.append((start, binding.var.name))
        elif isinstance(value, relax.Var) and value in storage_of:
            storage_of[binding.var] = storage_of[value]
        elif isinstance(value, relax.Call) and isinstance(value.op, relax.ExternFunc):
            name = value.op.global_symbol
            if name.startswith("raf_dist.ccl.") and name.endswith("_start"):
                busy = [storage_of[a] for a in value.args if a in storage_of]
                if busy:
                    in_flight[binding.var] = (busy, binding.var.name)
            elif name == "raf_dist.ccl.wait":
                in_flight.pop(value.args[0], None)
    return conflicts


def inflight_buffers(func):
    """Number of asynchronous collectives started in ``func`` (to make sure a check ran)."""
    return sum(1 for block in func.body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and isinstance(b.value.op, relax.ExternFunc)
               and b.value.op.global_symbol.startswith("raf_dist.ccl.")
               and b.value.op.global_symbol.endswith("_start"))
