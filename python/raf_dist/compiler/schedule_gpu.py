"""ScheduleGPU: TVM's dlight GPU rules for every PrimFunc of a CUDA step, tolerant of a rule
that fails on one kernel, plus the schedules dlight has none for: TVM's scatter-add (the
embedding gradient's take_backward) over GPU threads, and one GPU thread as the last resort.
The CPU schedules are in schedule.py, which also holds the scheduled attribute both set,
and scatter_add.py, which also holds the scatter-add kernel's matcher both use.
"""
import tvm

from .scatter_add import scatter_add_loops, with_scatter_add_loops
from .schedule import SCHEDULED


def _gpu_rules():
    from tvm.s_tir import dlight as dl
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            ScalarReductions(), dl.gpu.Fallback()]


class ScalarReductions:
    """A kernel of reductions to a single value (the mean of a loss, a gradient norm), with
    spatial blocks between them. dlight has no rule for it: GeneralReduction takes it and
    binds each block's one-element grid inside the serial reduction loop, so the step
    launched one kernel per element (TVM's legalised nll_loss: 2048 launches, 7.3 ms of a
    15 ms GPT step on an H200, bench/RESULTS.md), and Fallback runs each reduction on one
    thread. Here every block is its own kernel: a reduction whose output has one element
    runs on one block of threads, each thread summing a strided slice, then a cross-thread
    (warp shuffle) combine, as dlight's Reduction does per row; a spatial block gets
    Fallback's grid; a block with no loops, one thread. Applies only where some reduction
    has a single output element."""

    threads = 256

    def apply(self, func, target, _tunable):
        from tvm.s_tir import dlight as dl
        from tvm.s_tir.dlight.analysis import normalize_prim_func
        from tvm.s_tir.dlight.base import try_inline

        sch = tvm.s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        infos = try_inline(sch, infos)
        plans = []
        for info in infos:
            loops, kinds = sch.get_loops(info.block_rv), info.dom_kind()
            if "O" in kinds or any(sch.get(loop).thread_binding is not None for loop in loops):
                return None
            spatial = [loop for loop, kind in zip(loops, kinds) if kind == "S"]
            reduce = [loop for loop, kind in zip(loops, kinds) if kind == "R"]
            one_output = all(int(sch.get(loop).extent) == 1 for loop in spatial)
            plans.append((info.block_rv, spatial, reduce, one_output))
        if not any(reduce and one_output for _, _, reduce, one_output in plans):
            return None
        max_threads = dl.base.max_threads_per_block(target)
        for block, spatial, reduce, one_output in plans:
            if reduce and one_output:
                sch.reorder(*spatial, *reduce)
                outer, inner = sch.split(sch.fuse(*reduce), factors=[None, self.threads])
                sch.reorder(inner, outer)  # thread t sums elements t, t + 256, ...
                sch.bind(inner, "threadIdx.x")
                grid = sch.fuse(*spatial) if spatial else sch.add_unit_loop(inner)
                sch.bind(grid, "blockIdx.x")
                continue
            if not spatial:
                spatial = [sch.add_unit_loop(block)]
            sch.reorder(*spatial, *reduce)
            bx, tx = sch.split(sch.fuse(*spatial), factors=[None, max_threads])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            if reduce:
                sch.decompose_reduction(block, reduce[0])
        return sch


def run_on_one_gpu_thread(func):
    """The last-resort GPU schedule, for a kernel neither schedule_scatter_add nor a dlight
    rule takes (an opaque sequential block none of the test models produces): its whole body
    on one GPU thread. Correct for any kernel, slow for big ones."""
    body = func.body
    for tag in ("threadIdx.x", "blockIdx.x"):
        iv = tvm.tirx.IterVar(tvm.ir.Range(0, 1), tvm.tirx.Var(tag, "int32"), 1, tag)
        body = tvm.tirx.AttrStmt(iv, "thread_extent", 1, body)
    return func.with_body(body).with_attr(SCHEDULED, True)


_GPU_THREADS = 256  # threads per block of a kernel made from an independent loop


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
    matched = scatter_add_loops(func)
    if matched is None:
        return None
    return with_scatter_add_loops(func, matched,
                                   [_loop_on_gpu_threads(l, bind) for l in matched[3]])


def _lowers(func):
    """True if the scheduled kernel survives TIR's cross-thread reduction lowering (dlight
    can produce a cross-thread reduction of a combiner TVM then cannot lower)."""
    from tvm.s_tir import transform as st
    try:
        st.LowerCrossThreadReduction()(tvm.IRModule({"main": func}))
    except Exception:  # noqa: BLE001
        return False
    return True


def launches_once(func):
    """True if every GPU kernel of the scheduled ``func`` starts once per call: no loop of
    more than one iteration encloses a thread-bound loop from outside every thread binding
    (such a loop is left on the host, and each of its iterations launches the kernel)."""
    ok = True

    def visit(stmt, host_loop):
        nonlocal ok
        if isinstance(stmt, tvm.tirx.For):
            if stmt.thread_binding is not None:
                ok = ok and not host_loop
                return  # inside a kernel: its serial loops run on the GPU
            host_loop = host_loop or not (isinstance(stmt.extent, tvm.tirx.IntImm)
                                          and int(stmt.extent) == 1)
            visit(stmt.body, host_loop)
        elif isinstance(stmt, tvm.tirx.AttrStmt) and stmt.attr_key == "thread_extent":
            ok = ok and not host_loop
        elif isinstance(stmt, tvm.tirx.SeqStmt):
            for child in stmt.seq:
                visit(child, host_loop)
        elif isinstance(stmt, tvm.s_tir.SBlockRealize):
            visit(stmt.block, host_loop)
        elif isinstance(stmt, tvm.s_tir.SBlock):
            if stmt.init is not None:
                visit(stmt.init, host_loop)
            visit(stmt.body, host_loop)
        elif isinstance(stmt, tvm.tirx.IfThenElse):
            visit(stmt.then_case, host_loop)
            if stmt.else_case is not None:
                visit(stmt.else_case, host_loop)
        elif isinstance(getattr(stmt, "body", None), tvm.tirx.Stmt):
            visit(stmt.body, host_loop)

    visit(func.body, False)
    return ok


def schedule_gpu_prim_func(func, target, rules=None):
    """``func`` scheduled by schedule_scatter_add if it is take_backward, else by the first of
    dlight's GPU rules that applies to it and whose result lowers (every loop bound to GPU
    threads, each kernel launched once: see launches_once), else run_on_one_gpu_thread. A rule
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
        scheduled = sch.mod["main"].with_attr(SCHEDULED, True)
        if _lowers(scheduled) and launches_once(scheduled):
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
            if func.attrs is not None and int(func.attrs.get(SCHEDULED, 0)) == 1:
                continue
            updated[gvar] = schedule_gpu_prim_func(func, target, rules)
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updated.items():
            mod[gvar] = func
        return mod
