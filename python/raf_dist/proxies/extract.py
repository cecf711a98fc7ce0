"""A training step's communication, read from raf_dist's own compiled step.

``extract(model, MeshSpec(...))`` builds, in this one process and without MPI, the IR every
rank of that mesh would run — the model split for tensor parallelism (tp rank 0's pieces),
its embedding tables sharded (dp rank 0's), cut into pipeline stages, differentiated, through
the same distribution passes the executors apply (AllReduceGradients / ShardZeRO with their
buckets and overlap, LowerTensorParallel, LowerEmbeddingExchange) — and walks it in program
order: every ``raf_dist.ccl.*`` call becomes a collective event (kind, whole-tensor bytes,
axis, started here / waited there), the work between two of them one compute event (the
FLOPs of its matmuls and convolutions, the bytes its other operators write, how many
operator calls it makes: the host's share of a step, which the cost model charges per call). Under
pipelining each pp rank's program is its schedule (training/pipeline_schedule.py
``rank_actions``: the same action lists the PipelineExecutor runs) with each F / B action
replaced by its stage's forward / backward events, each SEND / RECV by a message of the
boundary's bytes, and UPDATE by the update step's events. The parameters may be shapes only
(``Model.without_values``, or placeholders: nothing here reads a value), so a 175B-parameter
model is extracted on a laptop.

Not in the events: the host-side bookkeeping messages of a step (the rows allgather of
uneven batches, the pipeline's loss broadcast and tied-weight sums: a few bytes each), and
the parameter broadcast at construction.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..compiler.build import apply_passes
from ..compiler.inplace_buckets import packed_call
from ..compiler.step_passes import function_passes
from ..ir.utils import tensor_nbytes
from ..layout.parallel import ParallelLayout
from ..passes.dispatch_blas import blas_operands
from ..runtime.metrics import call_flops, static_shape
from ..training import pipeline_schedule as schedules
from .workload import COLLECTIVES, Event, Workload, gemm_key

#: the process-group ids the extraction's passes are given, one per mesh axis (never run:
#: they only tag each collective with its axis)
AXIS_GROUPS = {"dp": 1001, "tp": 1002, "pp": 1003}
_AXIS_OF = {g: a for a, g in AXIS_GROUPS.items()}
_AXIS_OF[0] = "world"
_PREFIX = "raf_dist.ccl."
_MATMUL = tvm.ir.Op.get("relax.matmul")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """The parallel layout a workload is extracted for (``dist.get_config()``'s fields)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    bucket_mb: float = 25.0
    overlap: bool = True
    embedding_parallel: str = "none"
    stages_per_rank: int = 1
    recompute: str = "none"  # activation_checkpointing: "none", "full", "selective"
    #: under pipelining, each stage's level instead of ``recompute`` (what the Trainer's
    #: activation_memory_budget_mb chooses per stage: runtime/stage_budget.py); () = uniform
    stage_recompute: tuple = ()

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "microbatches", "stages_per_rank"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MeshSpec.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"MeshSpec.zero must be 0..3, got {self.zero!r}")
        if self.zero and self.dp == 1:
            raise ValueError("ZeRO shards over the dp ranks: zero > 0 needs dp > 1")
        if self.embedding_parallel not in ("none", "table", "row"):
            raise ValueError(f"embedding_parallel must be 'none', 'table' or 'row', got "
                             f"{self.embedding_parallel!r}")
        if self.recompute not in ("none", "full", "selective"):
            raise ValueError(f"recompute must be 'none', 'full' or 'selective', got "
                             f"{self.recompute!r}")
        if self.stage_recompute and (self.pp == 1 or any(
                lv not in ("none", "full", "selective") for lv in self.stage_recompute)):
            raise ValueError("stage_recompute takes one of 'none', 'full', 'selective' per "
                             f"pipeline stage (pp > 1), got {self.stage_recompute!r} with "
                             f"pp={self.pp}")
        self.layout.validate()  # every combination the Trainer refuses, refused alike

    @property
    def layout(self) -> ParallelLayout:
        """The ParallelLayout of rank 0 of this mesh (the Trainer's, for its refusals)."""
        return ParallelLayout.build(
            self.dp * self.tp * self.pp, 0, tp=self.tp, pp=self.pp,
            enable_data_parallel=self.dp > 1 or self.zero > 0, zero_level=self.zero,
            microbatches=self.microbatches, schedule=self.schedule,
            stages_per_rank=max(2, self.stages_per_rank),
            embedding_parallel=self.embedding_parallel)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def type_nbytes(ty) -> int:
    """Bytes of a tensor type; 0 for anything else or a symbolic shape (nothing to time)."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return 0
    try:
        return tensor_nbytes(ty)
    except TypeError:  # a symbolic dimension
        return 0


def _bindings(func: relax.Function):
    body = func.body
    return [b for block in body.blocks for b in block.bindings]


def function_events(func: relax.Function, what: str = "") -> list[Event]:
    """``func``'s compute and collective events in program order (module docstring).
    Collectives on a group outside AXIS_GROUPS (or 0, the world) are an error: the
    extraction tags every axis."""
    events: list[Event] = []
    pending: dict[Any, int] = {}
    work = [0, 0, 0]  # flops, bytes written, operator calls since the last collective
    gemms: dict[str, int] = {}  # and the float32 matmuls among the flops (Event.gemms)
    handles = iter(range(1 << 30))
    bindings = _bindings(func)
    bound = {b.var: b.value for b in bindings}

    def flush():
        if work[0] or work[1] or work[2]:
            events.append(Event("compute", flops=work[0], mem_bytes=work[1], ops=work[2],
                                what=what, gemms=dict(gemms)))
            work[0] = work[1] = work[2] = 0
            gemms.clear()

    for b in bindings:
        symbol, args = packed_call(b.value)
        if symbol is None or not symbol.startswith(_PREFIX):
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op):
                flops = call_flops(b.value)
                work[0] += flops
                work[2] += 1
                if not flops:
                    work[1] += type_nbytes(b.var.ty)
                elif b.value.op == _MATMUL and b.value.ty.dtype == "float32":
                    key = _gemm_key(b.value, bound)
                    if key is not None:
                        gemms[key] = gemms.get(key, 0) + 1
            continue
        op = symbol[len(_PREFIX):]
        if op == "wait":
            flush()
            events.append(Event("wait", handle=pending.pop(args[0]), what=what))
            continue
        kind = op[:-len("_start")] if op.endswith("_start") else op
        if kind not in COLLECTIVES:
            continue  # local copies (local_shard) and the like
        parts: list[int] = []  # a bucket's tensors, one runtime call each (Event.parts)
        if kind == "allreduce":
            group, nbytes = args[2], type_nbytes(args[0].ty)
        elif kind in ("reduce_scatter", "allgather"):
            tensors = args[:-3] if kind == "reduce_scatter" else args[2:]
            group = args[-2] if kind == "reduce_scatter" else args[1]
            parts = [type_nbytes(t.ty) for t in tensors]
            nbytes = sum(parts)
            parts = parts if len(parts) > 1 else []
        else:
            group, nbytes = args[-2], type_nbytes(args[0].ty)
        group = int(group.value)
        if group not in _AXIS_OF:
            raise ValueError(f"{symbol} on group {group}, which is no mesh axis of the "
                             "extraction")
        flush()
        handle = next(handles) if op.endswith("_start") else -1
        if handle >= 0:
            pending[b.var] = handle
        events.append(Event(kind, bytes=nbytes, axis=_AXIS_OF[group], handle=handle,
                            what=what, parts=parts))
    flush()
    if pending:
        raise ValueError(f"{what or 'the function'} starts {len(pending)} collective(s) it "
                         "never waits for")
    return events


def _gemm_key(call: relax.Call, bound: dict) -> str | None:
    """The ``gemm_key`` of a matmul as DispatchToBLAS hands it to the BLAS (None: it does
    not)."""
    operands = blas_operands(call, bound.get)
    if operands is None:
        return None
    a, trans_a, b, trans_b = operands
    shapes = [static_shape(x) for x in (a, b)]
    if shapes[0] is None or shapes[1] is None:  # a symbolic dimension: not a measured shape
        return None
    return gemm_key(shapes[0], shapes[1], bool(trans_a), bool(trans_b))


def _renumber(events: list[Event], start: int) -> tuple[list[Event], int]:
    """Copies of ``events`` whose handles count from ``start`` (a program repeats a
    function's events; each repeat's handles must be its own)."""
    out, top = [], start
    for e in events:
        e = dataclasses.replace(e)
        if e.handle >= 0:
            e.handle += start
            top = max(top, e.handle + 1)
        out.append(e)
    return out, top


def extract(model, mesh: MeshSpec, optimizer=None, loss: str = "cross_entropy",
            name: str = "", tensor_parallel_plan=None, embedding_plan=None) -> Workload:
    """The :class:`Workload` of one training iteration of ``model`` (captured with the
    global batch's rows divided by ``mesh.dp``, as each dp rank would) on ``mesh``."""
    from ..optim import AdamW

    optimizer = optimizer if optimizer is not None else AdamW(lr=1e-3)
    if mesh.pp == 1:
        programs = [_spmd_program(model, mesh, optimizer, loss, tensor_parallel_plan,
                                  embedding_plan)]
    else:
        programs = _pipeline_programs(model, mesh, optimizer, loss, tensor_parallel_plan)
    return Workload(name or model.source, mesh.dp, mesh.tp, mesh.pp, mesh.zero,
                    mesh.microbatches, mesh.schedule, programs,
                    source=f"extracted from raf_dist's step IR ({model.source})")


def _run_plan(mesh: MeshSpec):
    """The RunPlan of rank 0 of ``mesh`` (runtime/plan.py): its layout and settings."""
    from ..runtime.plan import RunPlan

    return RunPlan(layout=mesh.layout, config={},
                   bucket_bytes=max(1, int(mesh.bucket_mb * 2**20)), overlap_comm=mesh.overlap,
                   sync_batch_norm=False, split_points=None,
                   activation_checkpointing=None if mesh.recompute == "none" else mesh.recompute,
                   activation_memory_budget_mb=None)


def _spmd_program(model, mesh: MeshSpec, optimizer, loss: str, tensor_parallel_plan,
                  embedding_plan) -> list[Event]:
    """One rank's step (SPMD executor): with microbatches, M - 1 local accumulation steps and
    the final one with the gradient collectives. The steps and their passes are the
    Trainer's builder's (runtime/spmd_build.py, with no communicator), with axis-tagged
    groups and before library dispatch (DispatchToBLAS hides the matmuls the cost model
    counts)."""
    from ..runtime.spmd_build import planning_builder

    plan = _run_plan(mesh)
    builder = planning_builder(model.without_values(), loss, optimizer, plan,
                               groups=AXIS_GROUPS, tensor_parallel_plan=tensor_parallel_plan,
                               embedding_plan=embedding_plan)
    piece = builder.model  # tp rank 0's / dp rank 0's piece, as shapes
    M = mesh.microbatches
    rows = piece.batch_size
    if M > 1:
        if rows is None or rows % M:
            raise ValueError(f"{M} microbatches do not divide the model's {rows} rows per "
                             "dp rank")
        piece = piece.at_batch(rows // M)
    program: list[Event] = []
    top = 0
    kinds = [None] if M == 1 else ["partial"] * (M - 1) + ["final"]
    built: dict[Any, list[Event]] = {}
    for kind in kinds:
        if kind not in built:
            mod, _ = builder.step_at(piece, kind, plan.activation_checkpointing)
            passes = builder.passes(local=kind == "partial")
            mod = apply_passes(mod, passes[:len(passes) - len(function_passes())])
            built[kind] = function_events(mod["train_step"], f"step {kind or ''}".strip())
        events, top = _renumber(built[kind], top)
        program += events
    return program


def _pipeline_programs(model, mesh: MeshSpec, optimizer, loss: str,
                       tensor_parallel_plan) -> list[list[Event]]:
    """Each pp rank's schedule with its stages' events (module docstring): the stages and
    updates of the Trainer's builder (runtime/pipeline_build.py, with no communicator)."""
    from ..distributed.mesh import ProcessMesh
    from ..layout import stage_rank
    from ..passes.stage_split import split_forward
    from ..runtime.pipeline_build import PipelineBuilder
    from ..runtime.transport import tag

    # the MeshSpec's own schedule checked (its ``layout`` reads stages_per_rank as the config
    # does, at least 2; a spec asking interleaving with one stage per rank is refused here)
    schedules.num_stages(mesh.schedule, mesh.pp, mesh.stages_per_rank)
    plan = _run_plan(mesh)
    builder = PipelineBuilder(model.without_values(), loss, optimizer, plan,
                              ProcessMesh(plan.layout, AXIS_GROUPS), None, tvm.cpu(),
                              tvm.target.Target("llvm"), compute_dtype=None, loss_scale=False,
                              max_grad_norm=None, grad_reduce_dtype="float32", cache_dir=None,
                              dp_rank=0, tensor_parallel_plan=tensor_parallel_plan)
    S = builder.num_stages
    funcs = split_forward(builder.plan)
    frozen = list(builder.model.frozen_params)
    boundary = [type_nbytes(f.output_type) for f in funcs]
    if mesh.stage_recompute and len(mesh.stage_recompute) != S:
        raise ValueError(f"stage_recompute has {len(mesh.stage_recompute)} levels for {S} "
                         "pipeline stages")
    # the stages' passes before library dispatch (DispatchToBLAS hides the matmuls the cost
    # model counts)
    functions_only = len(function_passes())
    stage_events = []
    seen: dict[tuple, dict[str, list[Event]]] = {}
    for s, f in enumerate(funcs):
        # a stage equal to one already built up to parameter names (a transformer's middle
        # stages) has the same events: build and differentiate each distinct stage once
        # (the first stage has no input gradient, the last the loss; frozen parameters get
        # no gradient)
        level = mesh.stage_recompute[s] if mesh.stage_recompute else mesh.recompute
        key = (tvm_ffi.structural_hash(f.function.without_attr("global_symbol"),
                                       map_free_vars=True), s == 0, s == S - 1,
               tuple(f.buffers_written), tuple(n in frozen for n in f.param_names), level)
        if key in seen:
            stage_events.append({k: [dataclasses.replace(e, what=f"{k}{s}") for e in v]
                                 for k, v in seen[key].items()})
            continue
        fns, passes = builder.stage_ir(s, funcs, builder.plan_rows, frozenset(),
                                       level == "selective")
        mod = apply_passes(fns.mod, passes[:len(passes) - functions_only])
        # with activation checkpointing a stage saves nothing in F and runs its forward
        # again inside B (PipelineExecutor: forward_only, then recompute)
        full = level == "full"
        seen[key] = {
            "F": function_events(mod["forward_only" if full else "forward"], f"F{s}"),
            "B": function_events(mod["recompute" if full else "backward"], f"B{s}")}
        stage_events.append(seen[key])
    programs = []
    for r in range(mesh.pp):
        mine = [s for s in range(S) if stage_rank(s, mesh.pp) == r]
        names = [n for n in builder.model.param_names
                 if n not in frozen and any(n in builder.plan.params[s] for s in mine)]
        update_ir, passes = builder.update_step(names, optimizer, None)
        update_ir = apply_passes(update_ir, passes[:len(passes) - functions_only])
        update = function_events(update_ir["train_step"], "update")
        program: list[Event] = []
        top = 0
        for a in builder.actions[r]:
            if a.kind in ("F", "B"):
                events, top = _renumber(stage_events[a.stage][a.kind], top)
                program += events
            elif a.kind == "UPDATE":
                events, top = _renumber(update, top)
                program += events
            else:
                forward = a.kind.endswith("_F")
                cut = {"SEND_F": a.stage, "RECV_F": a.stage - 1, "SEND_B": a.stage - 1,
                       "RECV_B": a.stage}[a.kind]
                program.append(Event(
                    "send" if a.kind.startswith("SEND") else "recv", bytes=boundary[cut],
                    axis="pp", peer=a.peer, tag=tag("F" if forward else "B", cut, a.microbatch, S),
                    what=str(a)))
        programs.append(program)
    return programs


def recorded_collectives(before: dict, after: dict) -> dict[str, int]:
    """{kind: calls} between two ``dist.comm_counters()`` readings (tests compare a real
    step's calls with an extracted workload's)."""
    return {k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"] for k in after
            if after[k]["calls"] != before.get(k, {"calls": 0})["calls"]}

