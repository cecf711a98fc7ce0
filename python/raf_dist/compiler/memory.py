"""Planned memory of a lowered module: what StaticPlanBlockMemory decided to allocate."""
import tvm
from tvm import relax

from ..ir.ops import ARENA_VIEW
from .inplace_buckets import packed_call

_ALLOC_STORAGE = tvm.ir.Op.get("relax.memory.alloc_storage")
_ALLOC_TENSOR = tvm.ir.Op.get("relax.builtin.alloc_tensor")
_BUCKETS = ("raf_dist.bucket.empty", "raf_dist.bucket.pack")


def _is_start(symbol):
    """An asynchronous collective's start (``raf_dist.ccl.*_start``)."""
    return bool(symbol) and symbol.startswith("raf_dist.ccl.") and symbol.endswith("_start")


def static_size(shape_expr):
    """Elements of a ``ShapeExpr`` of constant dimensions, None otherwise."""
    if not isinstance(shape_expr, relax.ShapeExpr):
        return None
    size = 1
    for dim in shape_expr.values:
        if not isinstance(dim, tvm.tirx.IntImm):
            return None
        size *= int(dim.value)
    return size


def nbytes(numel, dtype):
    """Bytes of ``numel`` elements of ``dtype``."""
    dtype = tvm.DataType(str(dtype))
    return numel * ((dtype.bits + 7) // 8) * dtype.lanes


def planned_bytes(mod, func_name=None):
    """Bytes of storage the planned module allocates in one call of ``func_name`` (every Relax
    function when None): planned storage blocks, tensors the planner left unplanned (the
    function's outputs) and gradient buckets (``raf_dist.bucket.empty`` / ``pack``, allocated at
    run time). Run after StaticPlanBlockMemory."""
    total = 0

    def visit(expr):
        nonlocal total
        if not isinstance(expr, relax.Call):
            return
        if packed_call(expr)[0] in _BUCKETS:
            total += nbytes(static_size(expr.ty.shape) or 0, expr.ty.dtype)
        elif expr.op == _ALLOC_STORAGE:
            total += static_size(expr.args[0]) or 0
        elif expr.op == _ALLOC_TENSOR:
            total += nbytes(static_size(expr.args[0]) or 0, expr.args[1].value)

    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function) and func_name in (None, gvar.name_hint):
            relax.analysis.post_order_visit(func, visit)
    return total


_ALLOC_TENSOR_IN_STORAGE = tvm.ir.Op.get("relax.memory.alloc_tensor")


def inflight_storage_conflicts(func):
    """Bindings that touch the memory of a buffer an asynchronous collective is still reading
    or writing (between ``raf_dist.ccl.*_start`` and its ``wait``): an allocation the memory
    planner placed on its storage (or, in an arena, on its bytes: ``raf_dist.arena.view``,
    compiler/share_storage.py), or a call that takes the buffer or a view of it
    (``raf_dist.bucket.view``) — the silent corruption DESIGN.md section 5 describes. Run on a
    function after StaticPlanBlockMemory (and WriteGradientsIntoBuckets); returns
    [(start binding, conflicting binding)] (empty when safe)."""
    storage_of = {}  # tensor var -> storage var, through aliases
    region_of = {}  # arena view var -> (arena var, first byte, end byte), through aliases
    buffer_of = {}  # tensor var -> the tensor it aliases or views
    bindings = [b for block in func.body.blocks for b in block.bindings]
    in_flight = {}  # handle var -> (storages, regions, buffers the collective uses, start name)
    conflicts = []

    def root(var):
        while var in buffer_of:
            var = buffer_of[var]
        return var

    def overlaps(region, busy_regions):
        arena, lo, hi = region
        return any(a.same_as(arena) and lo < h and l < hi for a, l, h in busy_regions)

    for binding in bindings:
        value = binding.value
        symbol, args = packed_call(value)
        if isinstance(value, relax.Call) and value.op == _ALLOC_TENSOR_IN_STORAGE:
            storage = value.args[0]
            storage_of[binding.var] = storage
            for busy, _, _, start in in_flight.values():
                if any(b.same_as(storage) for b in busy):
                    conflicts.append((start, binding.var.name))
            continue
        if isinstance(value, relax.Var):
            buffer_of[binding.var] = value
            if value in storage_of:
                storage_of[binding.var] = storage_of[value]
            if value in region_of:
                region_of[binding.var] = region_of[value]
            continue
        if symbol == ARENA_VIEW:
            offset = int(args[1].value)
            region = (args[0], offset, offset + nbytes(static_size(args[2]) or 0, args[3].value))
            region_of[binding.var] = region
            conflicts.extend((start, binding.var.name) for _, regions, _, start
                             in in_flight.values() if overlaps(region, regions))
            continue
        if symbol == "raf_dist.bucket.view":
            buffer_of[binding.var] = args[0]
        if _is_start(symbol):
            busy = [storage_of[a] for a in args if a in storage_of]
            regions = [region_of[a] for a in args if a in region_of]
            buffers = {root(a) for a in args if isinstance(a, relax.Var)}
            in_flight[binding.var] = (busy, regions, buffers, binding.var.name)
        elif symbol == "raf_dist.ccl.wait":
            in_flight.pop(args[0], None)
        elif isinstance(value, relax.Call):
            used = {root(v) for v in relax.analysis.free_vars(value)}
            conflicts.extend((start, binding.var.name) for _, _, buffers, start
                             in in_flight.values() if used & buffers)
    return conflicts


def inflight_buffers(func):
    """Number of asynchronous collectives started in ``func`` (to make sure a check ran)."""
    return sum(1 for block in func.body.blocks for b in block.bindings
               if _is_start(packed_call(b.value)[0]))
