"""ScheduleCPU: a simple schedule for every PrimFunc TVM generates (after FuseTIR).

Input: a module whose PrimFuncs are unscheduled (LegalizeOps output, fused); functions that
carry ``tirx.is_scheduled`` (the attribute TVM 0.27 reads and its own pre-scheduled kernels
set) are left alone.
Output: the same functions, each marked ``tirx.is_scheduled``: TVM's scatter-add kernel
scheduled by its own rule (scatter_add.py), a kernel TVM wrote parallel already kept as it
is, every other one scheduled by ``schedule_prim_func`` (schedule.py: injective blocks
inlined, then the row-fused or the per-block schedule).

A kernel or block the schedule cannot handle stays serial, and never silently: it is logged
on the ``raf_dist`` logger, and under ``RAF_DIST_STRICT_SCHEDULE=1`` (raf_dist.env; the test
suite runs so) it raises ScheduleFallbackError. ``RAF_DIST_NO_SCHEDULE`` skips the pass, with
a warning.
"""
import logging

import tvm
import tvm_ffi

from .. import env
from .scatter_add import schedule_scatter_add_cpu
from .schedule import SCHEDULED, ScheduleFallbackError, report_fallback, schedule_prim_func

logger = logging.getLogger("raf_dist")


@tvm.transform.module_pass(opt_level=0, name="ScheduleCPU")
class ScheduleCPU:
    """See the module docstring. ``strict``: raise on a fallback (default: RAF_DIST_STRICT_SCHEDULE)."""

    def __init__(self, strict: "bool | None" = None):
        self.strict = strict

    def transform_module(self, mod, ctx):
        if env.skip_schedules():
            logger.warning("ScheduleCPU: RAF_DIST_NO_SCHEDULE is set: every kernel runs serial")
            return mod
        strict = env.strict_schedules() if self.strict is None else self.strict
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc) or (
                    func.attrs is not None and int(func.attrs.get(SCHEDULED, 0)) == 1):
                continue
            scheduled = schedule_scatter_add_cpu(func)
            if scheduled is None and _has_parallel_loop(func):
                scheduled = func  # scheduled by construction (TVM's cumsum scan), see below
            if scheduled is None:
                try:
                    scheduled = schedule_prim_func(func, gvar.name_hint, strict)
                except ScheduleFallbackError:
                    raise
                except Exception as error:  # noqa: BLE001 - reported (or raised) just below
                    report_fallback(gvar.name_hint, "(the whole kernel)",
                                    f"{type(error).__name__}: {str(error).strip()[-300:]}",
                                    strict)
                    continue
            updates[gvar] = scheduled.with_attr(SCHEDULED, True)
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def _has_parallel_loop(func):
    """True for a kernel TVM wrote already parallel: DispatchSortScan's CPU scan
    (``cumsum_generic``: one opaque block, a parallel loop over the rows, each scanned in
    order) has no block structure a schedule could work on, and needs none."""
    found = []
    tvm_ffi.structural_walk(func.body, [(tvm.tirx.For, lambda loop: found.append(
        loop.kind == tvm.tirx.ForKind.PARALLEL))])
    return any(found)
