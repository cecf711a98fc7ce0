"""TVM's scatter-add kernel (``take_backward``, the embedding gradient): its matcher and
rebuild, which the CPU and the GPU schedules share (schedule_gpu.py schedules it over GPU
threads), and its CPU schedule (``schedule_scatter_add_cpu``, which ScheduleCPU applies).

The kernel is one opaque block with no block axes, a sequence of serial loops, so
schedule_prim_func's rules (schedule.py) do not apply to it: left to them it would stay
serial on every model with an embedding.
"""
import tvm

from ..ir.attrs import VECTOR_LANES
from .schedule import MIN_PARALLEL_WORK, SCHEDULED, loop_work

_SCATTER_ADD_BLOCKS = ("take_backward",)  # TVM's opaque scatter-add kernels (legalize_ops.grad)


def scatter_add_loops(func):
    """(realize, block, scope, loops) of TVM's take_backward kernel: one opaque block whose
    body (possibly under an AttrStmt) is a sequence of serial loops of constant extent; None
    for any other kernel."""
    realize = func.body
    block = getattr(realize, "block", None)
    if block is None or block.name_hint not in _SCATTER_ADD_BLOCKS:
        return None
    scope = block.body
    seq = scope.body if isinstance(scope, tvm.tirx.AttrStmt) else scope
    loops = list(seq.seq) if isinstance(seq, tvm.tirx.SeqStmt) else [seq]
    if not all(isinstance(l, tvm.tirx.For) and l.kind == tvm.tirx.ForKind.SERIAL
               and isinstance(l.extent, tvm.tirx.IntImm) and 0 <= int(l.extent) < 2 ** 31
               for l in loops):
        return None
    return realize, block, scope, loops


def with_scatter_add_loops(func, matched, loops):
    """``func`` with the loops of its take_backward block (``matched``) replaced."""
    realize, block, scope, _ = matched
    seq = tvm.tirx.SeqStmt(loops)
    if isinstance(scope, tvm.tirx.AttrStmt):
        seq = tvm.tirx.AttrStmt(scope.node, scope.attr_key, scope.value, seq)
    from tvm.s_tir import stmt as sst
    block = sst.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, seq,
                       block.init, block.alloc_buffers, block.match_buffers, block.annotations)
    body = sst.SBlockRealize(realize.iter_values, realize.predicate, block)
    return func.with_body(body).with_attr(SCHEDULED, True)


def _column_bands(loop, width):
    """``for c in range(C): for k in range(N): body(c, k)`` (each c owns output column c) as
    ``for band in range(C / width): for k in range(N): for lane in range(width):
    body(band * width + lane, k)``: each pass over the rows k touches ``width`` contiguous
    columns instead of one, and every column still adds its rows in order."""
    inner = loop.body
    column = loop.loop_var
    band = tvm.tirx.Var("band", str(column.ty))
    lane = tvm.tirx.Var("lane", str(column.ty))
    body = tvm.tirx.SeqStmt([tvm.tirx.Bind(column, band * width + lane), inner.body])
    lanes = tvm.tirx.For(lane, 0, width, tvm.tirx.ForKind.SERIAL, body)
    rows = tvm.tirx.For(inner.loop_var, inner.min, inner.extent, tvm.tirx.ForKind.SERIAL, lanes)
    return tvm.tirx.For(band, 0, int(loop.extent) // width, tvm.tirx.ForKind.SERIAL, rows)


def _parallel(loop):
    """``loop`` run in parallel when it is large enough to pay for the thread pool."""
    if int(loop.extent) > 1 and int(loop.extent) * loop_work(loop.body) >= MIN_PARALLEL_WORK:
        return tvm.tirx.For(loop.loop_var, loop.min, loop.extent, tvm.tirx.ForKind.PARALLEL,
                            loop.body)
    return loop


def schedule_scatter_add_cpu(func):
    """take_backward (see schedule_gpu.schedule_scatter_add) on the CPU: the zeroing loop in
    parallel, the accumulation over bands of 16 (or 8) contiguous columns, the bands in
    parallel (each walks the rows in order: deterministic, no atomics); the loops still run
    one after the other. None for any other kernel."""
    matched = scatter_add_loops(func)
    if matched is None:
        return None
    loops = []
    for loop in matched[3]:
        inner = loop.body
        if (isinstance(inner, tvm.tirx.For) and inner.kind == tvm.tirx.ForKind.SERIAL
                and not isinstance(inner.body, tvm.tirx.For)):
            width = next((w for w in (2 * VECTOR_LANES, VECTOR_LANES)
                          if int(loop.extent) % w == 0), None)
            if width is not None:
                loop = _column_bands(loop, width)
        loops.append(_parallel(loop))
    return with_scatter_add_loops(func, matched, loops)
