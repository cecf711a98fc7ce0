"""The CPU schedule of one kernel (``schedule_prim_func``), which ScheduleCPU (schedule_cpu.py)
applies to every PrimFunc of a step: injective intermediate blocks inlined into their
consumers, then one of two schedules:

- *Row-fused*: a kernel whose output block is elementwise over rows and whose other blocks
  (reductions along the row such as a mean or a softmax's max and sum, materialised
  intermediates) each need only the row the output computes — layer norm, softmax,
  log-softmax, the pieces of their gradients: every block is computed inside one parallel
  loop over the rows, so a row is read from L1 and the thread pool is woken once.
- *Per block*: for each remaining block, the leading data-parallel loops fused and run in
  parallel when the work is large enough to pay for the thread pool, and a fully
  data-parallel block's innermost 8 elements vectorised when its innermost axis is a
  multiple of 8 (else its rows stay plain loops under the parallel outer axes); a column
  reduction (a bias gradient) walks rows in order, a band of up to 64 columns at a time.

In both, a reduction along the contiguous innermost axis accumulates 8 partial sums in
vector lanes (``rfactor``) and adds the 8 at the end of the row; a scalar loop-carried
accumulation is what LLVM emits otherwise (it may not reassociate float adds), 4-10x slower.
A block annotated MATERIALIZE is not inlined.

A block the schedule cannot handle stays as it was: a serial loop nest, which for a large
kernel is two orders of magnitude slower than its scheduled form. Such a fallback is never
silent: it is logged on the ``raf_dist`` logger (function, block and why), and under
``RAF_DIST_STRICT_SCHEDULE=1`` (raf_dist.env; the test suite runs so) it raises
ScheduleFallbackError. Blocks too small to pay for the thread pool are serial by design and
are not fallbacks.
"""
import logging
import math

import tvm
import tvm_ffi
from tvm.s_tir import Schedule
from tvm.s_tir.schedule import ScheduleError

from ..ir.attrs import LONG_ROW, MATERIALIZE, VECTOR_LANES

logger = logging.getLogger("raf_dist")

MIN_PARALLEL_WORK = 1 << 14  # elements: below this, waking the pool costs more than it saves
_VECTOR = VECTOR_LANES  # float32 lanes in an AVX2 register
SCHEDULED = "tirx.is_scheduled"  # TVM 0.27's attribute (tir::attr::kIsScheduled)


@tvm_ffi.register_error  # keeps its type when it crosses TVM's pass infrastructure
class ScheduleFallbackError(RuntimeError):
    """A kernel ScheduleCPU could not schedule, in strict mode."""


def report_fallback(func_name, block_name, reason, strict):
    """Report a kernel (or one block of it) left unscheduled: a warning, or in strict mode
    an error naming the kernel, the block and the reason."""
    message = (f"ScheduleCPU: kernel {func_name!r}, block {block_name!r} left unscheduled "
               f"(serial, not vectorised): {reason}")
    if strict:
        raise ScheduleFallbackError(
            f"{message}. RAF_DIST_STRICT_SCHEDULE=1 makes this an error: teach "
            "raf_dist/compiler/schedule.py this block's shape, or unset the variable to run "
            "the kernel unscheduled")
    logger.warning(message)


def loop_work(stmt):
    """Iterations of the loops inside ``stmt`` (an upper bound: the product of every loop's
    extent; a loop of unknown extent counts as large)."""
    work = [1]

    def visit(loop):
        extent = loop.extent
        work[0] *= int(extent) if isinstance(extent, tvm.tirx.IntImm) else MIN_PARALLEL_WORK

    tvm_ffi.structural_walk(stmt, [(tvm.tirx.For, visit)])
    return work[0]


def _extent(loop_rv, sch):
    extent = sch.get(loop_rv).extent
    return int(extent) if isinstance(extent, tvm.tirx.IntImm) else None


def _fills_lanes(extent):
    """True when ``extent`` splits into at least two whole vectors of _VECTOR lanes."""
    return extent is not None and extent % _VECTOR == 0 and extent >= 2 * _VECTOR


#: an output row at least this long that the lanes do not divide still gets the row-fused
#: schedule, its own loop split into vectors with the last one predicated (a T.where on the
#: output block, which is never moved: TVM 0.27's compute_at drops a moved block's
#: predicate). The fused loss's gradient over GPT-2's 50257 classes; its statistics run on a
#: padded copy (training/cross_entropy.py). Short odd rows (ViT's 65 tokens) stay per block
_LONG_ROW = LONG_ROW


def _long_row(extent):
    """A row of at least _LONG_ROW elements that the lanes do not divide."""
    return extent is not None and extent % _VECTOR != 0 and extent >= _LONG_ROW


def _reduces_across_rows(sblock, lead):
    """True when the block reduces over leading axes of a buffer whose last index is the
    innermost data-parallel variable (a column sum such as a bias gradient): its reduction
    loop then strides over whole rows unless it is moved outside the column loop."""
    last_spatial = sblock.iter_vars[lead - 1].var
    for region in sblock.reads:
        last = region.region[-1].min
        if isinstance(last, tvm.tirx.Var) and last.same_as(last_spatial) and len(region.region) > 1:
            return True
    return False


#: a column reduction's bands: the widest of these that leaves _MIN_BANDS bands. Wide bands
#: read whole cache lines per row and keep several vector accumulators busy (a [1024, 512]
#: bias gradient: 8 columns 0.15 ms, 64 columns 0.04 ms)
_BAND_WIDTHS = (64, 32, 16)
_MIN_BANDS = 8


def _schedule_column_reduction(sch, block, loops, lead, extents):
    """[spatial..., reduce...] -> [spatial outer (parallel), reduce..., band]: each thread
    owns bands of contiguous columns and walks the rows in order, a band's columns at a time
    (LLVM vectorises the band's loop)."""
    columns = math.prod(extents[:lead])
    width = next((w for w in _BAND_WIDTHS if columns % w == 0 and columns // w >= _MIN_BANDS),
                 _VECTOR)
    spatial = sch.fuse(*loops[:lead]) if lead > 1 else loops[0]
    outer, inner = sch.split(spatial, [None, width])
    sch.reorder(outer, *loops[lead:], inner)
    sch.parallel(outer)  # before decompose_reduction, which TVM then refuses to parallelise
    sch.decompose_reduction(block, loops[lead])


def _reads_contiguous_in(sblock, var):
    """True when some buffer the block reads has ``var`` as its last (contiguous) index."""
    for region in sblock.reads:
        last = region.region[-1].min
        if isinstance(last, tvm.tirx.Var) and last.same_as(var):
            return True
    return False


def _is_row_reduction(sch, block):
    """A block reducing along one innermost axis that is contiguous in memory (a row sum, max
    or mean) with an extent the vector lanes divide: [spatial..., reduce]."""
    sblock = sch.get(block)
    loops = sch.get_loops(block)
    kinds = [iv.iter_type for iv in sblock.iter_vars]
    if len(loops) != len(kinds) or len(kinds) < 2 or kinds[-1] != tvm.tirx.IterVar.CommReduce:
        return False
    if any(kind != tvm.tirx.IterVar.DataPar for kind in kinds[:-1]):
        return False
    if not _fills_lanes(_extent(loops[-1], sch)):
        return False
    return _reads_contiguous_in(sblock, sblock.iter_vars[-1].var)


def _rfactor_lanes(sch, block):
    """Split a row reduction's axis into (k / 8, 8) and factor the 8 out: a new block keeps 8
    partial results per row (returned), the original block then reduces those 8."""
    _, lanes = sch.split(sch.get_loops(block)[-1], [None, _VECTOR])
    return sch.rfactor(lanes, factor_axis=len(sch.get(block).iter_vars) - 1)


def _vectorise_partials(sch, rf):
    """The partial-result block of _rfactor_lanes, under its row: compute_at lays its loops out
    in axis order (lanes, k / 8); put the lanes innermost and vectorise them. Returns the
    k / 8 loop, where the initialisation is split off (decompose_reduction, which must come
    after ``parallel``: TVM refuses to parallelise a loop over a decomposed reduction)."""
    loops = sch.get_loops(rf)
    sch.reorder(loops[-1], loops[-2])
    loops = sch.get_loops(rf)
    sch.vectorize(loops[-1])
    return loops[-2]


def _schedule_row_reduction(sch, block, lead, work):
    """[rows..., k] -> parallel rows { 8 lanes of partial results over k / 8 steps; 8 adds }."""
    rf = _rfactor_lanes(sch, block)
    final = sch.get_loops(block)
    rows = sch.fuse(*final[:lead]) if lead > 1 else final[0]
    sch.compute_at(rf, rows)
    init_at = _vectorise_partials(sch, rf)
    if work >= MIN_PARALLEL_WORK:
        sch.parallel(rows)
    sch.decompose_reduction(rf, init_at)


def _stores_16bit_constant(sblock):
    """A fill of a bfloat16 / float16 constant (``R.zeros(..., "bfloat16")``: the zero
    adjoints autodiff makes under mixed precision). TVM 0.27's BF16 storage legalisation
    cannot lower a vector store of one (a bfloat16x8 value into the uint16 buffer: a
    TypeError at build), so such a fill stays scalar; it is parallel all the same."""
    body = sblock.body
    return (isinstance(body, tvm.tirx.BufferStore) and isinstance(body.value, tvm.tirx.FloatImm)
            and str(body.buffer.dtype) in ("bfloat16", "float16"))  # (FloatImm has no dtype)


def _schedule_block(sch, block):
    """Schedule one block; returns None when done (or when it is too small to be worth
    scheduling), else why it was left as it was."""
    sblock = sch.get(block)
    loops = sch.get_loops(block)
    kinds = [iv.iter_type for iv in sblock.iter_vars]
    if not kinds:  # an opaque block: its loops, if any, are inside its body
        if loop_work(sblock.body) * _work_of_loops(loops, sch) < MIN_PARALLEL_WORK:
            return None  # small: serial by design
        return "an opaque block (its loops are inside the block, with no block axes)"
    if not loops:
        return None  # a scalar: nothing to schedule
    extents = [_extent(loop, sch) for loop in loops]
    work = 1
    for e in extents:
        work = work * e if e is not None and work is not None else None
    if len(loops) != len(kinds):
        return (f"its {len(loops)} loops do not map one to one to its {len(kinds)} block "
                "axes (an opaque or imperfect loop nest)")
    if work is None:
        return f"loop extents {extents} are not all constants"
    lead = 0
    while lead < len(kinds) and kinds[lead] == tvm.tirx.IterVar.DataPar:
        lead += 1
    if lead == 0:
        if work < MIN_PARALLEL_WORK:
            return None  # a small reduction to a scalar: serial by design
        return f"a reduction over all {work} elements with no data-parallel outer loop"
    if (lead < len(loops) and extents[lead - 1] % _VECTOR == 0 and work >= MIN_PARALLEL_WORK
            and _reduces_across_rows(sblock, lead)):
        _schedule_column_reduction(sch, block, loops, lead, extents)
        return None
    if lead == len(loops) - 1 and _is_row_reduction(sch, block):
        _schedule_row_reduction(sch, block, lead, work)
        return None
    all_spatial = lead == len(loops)
    if all_spatial and lead > 1 and extents[-1] % _VECTOR:
        # vector lanes would cross rows of the innermost axis (a 3x3 kernel's weight, a 4x4
        # map): TVM then computes every lane's index with divisions and gathers, 8x slower
        # than the same work on a flat tensor (measured: an Adam moment update on a
        # 512x512x3x3 weight 3.3 ms, on the same elements as one axis 0.41 ms; now 0.47 ms). The outer
        # axes run in parallel, the innermost row stays a plain loop LLVM unrolls.
        outer = sch.fuse(*loops[:-1]) if lead > 2 else loops[0]
        if work >= MIN_PARALLEL_WORK:
            sch.parallel(outer)
        return None
    spatial = sch.fuse(*loops[:lead]) if lead > 1 else loops[0]
    spatial_extent = math.prod(extents[:lead])
    if all_spatial and _fills_lanes(spatial_extent) and not _stores_16bit_constant(sblock):
        outer, inner = sch.split(spatial, [None, _VECTOR])
        sch.vectorize(inner)
        spatial = outer
    if work >= MIN_PARALLEL_WORK and spatial_extent > 1:
        sch.parallel(spatial)
    return None


def _work_of_loops(loops, sch):
    work = 1
    for loop in loops:
        extent = _extent(loop, sch)
        work *= extent if extent is not None else MIN_PARALLEL_WORK
    return work


def _inlinable(sch, block):
    """A block compute_inline may take: every axis data-parallel (an injective block), not
    annotated MATERIALIZE."""
    sblock = sch.get(block)
    if MATERIALIZE in (sblock.annotations or {}):
        return False
    return all(iv.iter_type == tvm.tirx.IterVar.DataPar for iv in sblock.iter_vars)


#: rows below which a row-fused kernel would leave threads idle: the blocks are then
#: scheduled one by one (each parallel over its own loops)
_MIN_ROWS = 16


class _NotRowWise(Exception):
    """The kernel is not row-wise: schedule its blocks one by one."""


def _schedule_rows(sch):
    """The row-fused schedule (module docstring) on ``sch``, or _NotRowWise / ScheduleError
    (``sch`` is then half-transformed: the caller starts again from a copy).

    The output block [rows..., columns] is elementwise; every other block is computed at its
    row loop (compute_at, consumers first), which is only done when that costs no work: a block
    whose per-row share times the rows is not its whole work would be recomputed for every
    row, and the kernel is not row-wise. Row reductions become 8 vector lanes of partial
    results first (rfactor needs the reduction's own loop nest, so before compute_at)."""
    root = sch.get_sblock("root")
    blocks = sch.get_child_blocks(root)
    if len(blocks) < 2:
        raise _NotRowWise("one block")
    out = blocks[-1]
    out_name = sch.get(out).name_hint
    loops = sch.get_loops(out)
    kinds = [iv.iter_type for iv in sch.get(out).iter_vars]
    if (len(loops) != len(kinds) or len(kinds) < 2
            or any(kind != tvm.tirx.IterVar.DataPar for kind in kinds)):
        raise _NotRowWise("the output block is not elementwise over rows")
    extents = [_extent(loop, sch) for loop in loops]
    if None in extents:
        raise _NotRowWise("loop extents are not all constants")
    n_rows = math.prod(extents[:-1])
    if n_rows < _MIN_ROWS:
        raise _NotRowWise(f"{n_rows} rows")
    if extents[-1] % _VECTOR and extents[-1] != 1 and not _long_row(extents[-1]):
        # rows the vector lanes do not divide (ViT's 65 tokens): no lanes in the fused loop
        # nest, and it measured slower than block by block (ViT's softmax 0.72 ms against
        # 0.61)
        raise _NotRowWise(f"rows of {extents[-1]}, not a multiple of {_VECTOR}")
    # the kernel's largest block, not its output, decides the pool: a row's loss reads the
    # whole row to write one value
    work = max(_work_of_loops(sch.get_loops(block), sch) for block in blocks)
    partials = [_rfactor_lanes(sch, block) for block in blocks[:-1]
                if _is_row_reduction(sch, block)]
    rows = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    for block in reversed(sch.get_child_blocks(root)[:-1]):
        block_work = _work_of_loops(sch.get_loops(block), sch)
        sch.compute_at(block, rows, preserve_unit_loops=False)
        if _work_of_loops(sch.get_loops(block)[1:], sch) * n_rows != block_work:
            raise _NotRowWise(f"block {sch.get(block).name_hint!r} would be recomputed per row")
    partial_names = {sch.get(block).name_hint for block in partials}
    decompose = []
    for block in sch.get_child_blocks(rows):
        if sch.get(block).name_hint in partial_names:
            decompose.append((block, _vectorise_partials(sch, block)))
            continue
        inner = sch.get_loops(block)
        if len(inner) < 2 or any(iv.iter_type != tvm.tirx.IterVar.DataPar
                                 for iv in sch.get(block).iter_vars):
            continue  # a reduction of the 8 partial results, or one along a short row
        extent = _extent(inner[-1], sch)
        if _fills_lanes(extent) or (_long_row(extent) and sch.get(block).name_hint == out_name):
            _, lanes = sch.split(inner[-1], [None, _VECTOR])
            sch.vectorize(lanes)
    if work >= MIN_PARALLEL_WORK:
        sch.parallel(rows)
    for block, loop in decompose:
        sch.decompose_reduction(block, loop)


def schedule_prim_func(func, name="main", strict=False):
    """``func`` with its injective intermediate blocks inlined and every block scheduled (see
    the module docstring); a block left unscheduled is logged, or raises when ``strict``."""
    sch = Schedule(func)
    root = sch.get_sblock("root")
    outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
    for block in sch.get_child_blocks(root):
        block_name = sch.get(block).name_hint
        if block_name in outputs or not _inlinable(sch, block):
            continue  # reductions and outputs stay blocks of their own
        try:
            sch.compute_inline(block)
        except ScheduleError as error:
            # not a fallback: the block keeps its own loop nest and is scheduled below
            logger.debug("ScheduleCPU: kernel %r: block %r not inlined: %s", name, block_name,
                         str(error).strip().splitlines()[-1])
    inlined = sch.mod["main"]
    try:
        _schedule_rows(sch)
        return sch.mod["main"]
    except (_NotRowWise, ScheduleError, tvm.error.InternalError) as why:
        # not a fallback: the blocks are scheduled one by one below. (TVM 0.27's compute_at
        # can fail a check instead of raising ScheduleError: InverseAffineIterMap on a
        # data-dependent read, the fused loss's target logit before it read the logits)
        logger.debug("ScheduleCPU: kernel %r not row-fused: %s", name,
                     str(why).strip().splitlines()[-1])
    sch = Schedule(inlined)
    root = sch.get_sblock("root")
    for block in sch.get_child_blocks(root):
        block_name = sch.get(block).name_hint
        try:
            reason = _schedule_block(sch, block)
        except ScheduleError as error:  # a primitive refused: the block keeps its loops
            reason = f"TVM refused a schedule primitive: {str(error).strip().splitlines()[-1]}"
        if reason is not None:
            report_fallback(name, block_name, reason, strict)
    return sch.mod["main"]
