"""ScheduleCPU: a simple schedule for every PrimFunc TVM generates (after FuseTIR).

Input: a module whose PrimFuncs are unscheduled (LegalizeOps output, fused).
Output: the same functions with injective intermediate blocks inlined into their consumers;
for each remaining block, the leading data-parallel loops fused and run in parallel when the
work is large enough to pay for the thread pool, and a fully data-parallel block's innermost
8 elements vectorised. Blocks the schedule cannot handle are left as they were.
"""
import os

import tvm
from tvm.s_tir import Schedule

_MIN_PARALLEL_WORK = 1 << 14  # elements: below this, waking the pool costs more than it saves
_VECTOR = 8  # float32 lanes in an AVX2 register


def _extent(loop_rv, sch):
    extent = sch.get(loop_rv).extent
    return int(extent) if isinstance(extent, tvm.tirx.IntImm) else None


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


def _schedule_column_reduction(sch, block, loops, lead, extents):
    """[spatial..., reduce...] -> [spatial outer (parallel), reduce..., 8 columns]: each
    thread owns a band of columns and walks the rows in order, 8 contiguous columns at a time."""
    spatial = sch.fuse(*loops[:lead]) if lead > 1 else loops[0]
    outer, inner = sch.split(spatial, [None, _VECTOR])
    sch.reorder(outer, *loops[lead:], inner)
    sch.parallel(outer)  # before decompose_reduction, which TVM then refuses to parallelise
    sch.decompose_reduction(block, loops[lead])


def _schedule_block(sch, block):
    sblock = sch.get(block)
    loops = sch.get_loops(block)
    kinds = [iv.iter_type for iv in sblock.iter_vars]
    if len(loops) != len(kinds) or not loops:
        return
    extents = [_extent(loop, sch) for loop in loops]
    if any(e is None for e in extents):
        return
    lead = 0
    while lead < len(kinds) and kinds[lead] == tvm.tirx.IterVar.DataPar:
        lead += 1
    if lead == 0:
        return
    work = 1
    for e in extents:
        work *= e
    if (lead < len(loops) and extents[lead - 1] % _VECTOR == 0 and work >= _MIN_PARALLEL_WORK
            and _reduces_across_rows(sblock, lead)):
        _schedule_column_reduction(sch, block, loops, lead, extents)
        return
    spatial = sch.fuse(*loops[:lead]) if lead > 1 else loops[0]
    spatial_extent = 1
    for e in extents[:lead]:
        spatial_extent *= e
    all_spatial = lead == len(loops)
    if all_spatial and spatial_extent % _VECTOR == 0 and spatial_extent >= 2 * _VECTOR:
        outer, inner = sch.split(spatial, [None, _VECTOR])
        sch.vectorize(inner)
        spatial = outer
    if work >= _MIN_PARALLEL_WORK and spatial_extent > 1:
        sch.parallel(spatial)


def schedule_prim_func(func):
    sch = Schedule(func)
    root = sch.get_sblock("root")
    outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
    for block in sch.get_child_blocks(root):
        if sch.get(block).name_hint in outputs:
            continue
        try:
            sch.compute_inline(block)
        except Exception:  # not injective / not inlinable: keep the block
            pass
    for block in sch.get_child_blocks(root):
        try:
            _schedule_block(sch, block)
        except Exception:  # leave this block unscheduled rather than fail the build
            pass
    return sch.mod["main"]


@tvm.transform.module_pass(opt_level=0, name="ScheduleCPU")
class ScheduleCPU:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        if os.environ.get("RAF_DIST_NO_SCHEDULE"):
            return mod
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, tvm.tirx.PrimFunc) and not func.attrs.get("tir.is_scheduled"):
                try:
                    updates[gvar] = schedule_prim_func(func).with_attr("tir.is_scheduled", True)
                except Exception:
                    continue
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def _gpu_rules():
    from tvm.s_tir import dlight as dl
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback()]


def run_on_one_gpu_thread(func):
    """The last-resort GPU schedule, for a kernel neither schedule_scatter_add nor a dlight
    rule takes (an opaque sequential block none of the test models produces): its whole body
    on one GPU thread. Correct for any kernel, slow for big ones."""
    body = func.body
    for tag in ("threadIdx.x", "blockIdx.x"):
        iv = tvm.tirx.IterVar(tvm.ir.Range(0, 1), tvm.tirx.Var(tag, "int32"), 1, tag)
        body = tvm.tirx.AttrStmt(iv, "thread_extent", 1, body)
    return func.with_body(body).with_attr("tirx.is_scheduled", True)


_GPU_THREADS = 256  # threads per block of a kernel made from an independent loop
_SCATTER_ADD_BLOCKS = ("take_backward",)  # TVM's opaque scatter-add kernels (legalize_ops.grad)


def _loop_on_gpu_threads(loop, bind=True):
    """``for v in range(n): body`` as a grid of n GPU threads, thread v running ``body``:
    blockIdx.x * 256 + threadIdx.x binds v, a guard drops the tail of the last block.
    ``bind=False`` keeps the grid as two serial loops (the CPU tests run it that way)."""
    extent = int(loop.extent)
    threads = min(extent, _GPU_THREADS)
    blocks = -(-extent // threads)
    bx, tx = tvm.tirx.Var("bx", "int32"), tvm.tirx.Var("tx", "int32")
    index = bx * threads + tx
    v = loop.loop_var
    body = loop.body if blocks * threads == extent else tvm.tirx.IfThenElse(
        index < extent, loop.body, None)
    body = tvm.tirx.SeqStmt([tvm.tirx.Bind(v, index.astype(str(v.ty))), body])

    def bound(var, n, tag, stmt):
        if not bind:
            return tvm.tirx.For(var, 0, n, tvm.tirx.ForKind.SERIAL, stmt)
        iv = tvm.tirx.IterVar(tvm.ir.Range(0, n), var, 1, tag)  # 1: thread index
        return tvm.tirx.For(var, 0, n, tvm.tirx.ForKind.THREAD_BINDING, stmt, thread_binding=iv)

    return bound(bx, blocks, "blockIdx.x", bound(tx, threads, "threadIdx.x", body))


def schedule_scatter_add(func, bind=True):
    """TVM's take_backward (the embedding gradient) is one opaque block of two loops run in
    sequence: zero the output, then for each (leading index, column) of the output walk the
    indices and add rows. Every iteration of either loop touches its own output elements
    (the second loop's iteration owns a column, its inner walk stays serial, so repeated
    indices add in order, deterministically). Each loop becomes its own kernel over GPU
    threads — one launch after the other on the stream, so the zeroing finishes first.
    Returns None for any other kernel or shape; ``bind``: see _loop_on_gpu_threads."""
    realize = func.body
    block = getattr(realize, "block", None)
    if block is None or block.name_hint not in _SCATTER_ADD_BLOCKS:
        return None
    scope = block.body
    seq = scope.body if isinstance(scope, tvm.tirx.AttrStmt) else scope
    loops = list(seq.seq) if isinstance(seq, tvm.tirx.SeqStmt) else [seq]
    if not all(isinstance(l, tvm.tirx.For) and l.kind == tvm.tirx.ForKind.SERIAL
               and isinstance(l.extent, tvm.tirx.IntImm) and 0 < int(l.extent) < 2 ** 31
               for l in loops):
        return None
    seq = tvm.tirx.SeqStmt([_loop_on_gpu_threads(l, bind) for l in loops])
    if isinstance(scope, tvm.tirx.AttrStmt):
        seq = tvm.tirx.AttrStmt(scope.node, scope.attr_key, scope.value, seq)
    from tvm.s_tir import stmt as sst
    block = sst.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, seq,
                       block.init, block.alloc_buffers, block.match_buffers, block.annotations)
    body = sst.SBlockRealize(realize.iter_values, realize.predicate, block)
    return func.with_body(body).with_attr("tirx.is_scheduled", True)


def _lowers(func):
    """True if the scheduled kernel survives TIR's cross-thread reduction lowering (dlight
    can produce a cross-thread reduction of a combiner TVM then cannot lower)."""
    from tvm.s_tir import transform as st
    try:
        st.LowerCrossThreadReduction()(tvm.IRModule({"main": func}))
    except Exception:  # noqa: BLE001
        return False
    return True


def schedule_gpu_prim_func(func, target, rules=None):
    """``func`` scheduled by schedule_scatter_add if it is take_backward, else by the first of
    dlight's GPU rules that applies to it and whose result lowers (every loop bound to GPU
    threads), else run_on_one_gpu_thread. A rule
    that raises on a kernel it claims is skipped — in TVM 0.27 dlight's Reduction asserts on
    some training-step reductions (``detect_dominant_read``) and others yield cross-thread
    reductions TVM cannot lower ("No matched reducer") — and the next rule tried."""
    scatter_add = schedule_scatter_add(func)
    if scatter_add is not None:
        return scatter_add
    for rule in rules or _gpu_rules():
        try:
            space = rule.apply(func, target, False)
        except Exception:  # noqa: BLE001 - a rule's own bug: the next rule schedules it
            continue
        if space is None:
            continue
        sch = space[0] if isinstance(space, (list, tuple)) else space
        scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        if _lowers(scheduled):
            return scheduled
    return run_on_one_gpu_thread(func)


@tvm.transform.module_pass(opt_level=0, name="ScheduleGPU")
class ScheduleGPU:
    """dlight's default GPU schedules (what TVM's CUDA pipeline applies), tolerant of a rule
    that fails on one kernel: see ``schedule_gpu_prim_func``. Run under the CUDA target."""

    def transform_module(self, mod, ctx):
        target = tvm.target.Target.current(allow_none=False)
        rules = _gpu_rules()
        updated = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            if func.attrs is not None and int(func.attrs.get("tirx.is_scheduled", 0)) == 1:
                continue
            updated[gvar] = schedule_gpu_prim_func(func, target, rules)
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updated.items():
            mod[gvar] = func
        return mod
