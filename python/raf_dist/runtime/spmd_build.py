"""Building the SPMD executor's step, apart from running it (DESIGN.md section 2, runtime/).

``SPMDBuilder`` takes the model, the run's plan (its ``ParallelLayout``) and the options, and
builds: this rank's tp piece of the model (training/tensor_parallel.py) and sharded tables
(training/embedding_parallel.py), the training step's IR and signature (``build_step``, with
the recomputation chosen under ``activation_memory_budget_mb``: runtime/stage_budget.py's
``first_fitting``), the captured step compiled with the passes the plan asks for
(``compile_captured``) and a step for any other batch size (``compile_variant``). The
artifacts are ``StepIR`` and ``CompiledStep``; runtime/spmd_executor.py runs them.

MPI in construction (marked on each method): the tp split and the table shards broadcast
world / dp rank 0's initial values, the budget with sharded tables agrees over the dp group,
and the captured step compiles behind a barrier (one compile per host into the cache).

``plan_step`` is the same builder with no communicator: a rank's step as the Trainer would
build it (split, IR, passes, StateLayout) and nothing compiled, for the tools that read it
without running a job (tools/estimate_memory.py, proxies/extract.py): one description of
the step, so an estimate cannot drift from what runs.
"""
import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tvm
from tvm import relax

from ..compiler import compile_step
from ..compiler.build import plan_memory
from ..compiler.step_passes import nonfinite_guard, step_passes
from ..distributed import collectives
from ..distributed.mesh import ProcessMesh
from ..layout import state_layout
from ..passes import gradient_buckets, remat
from ..passes.batch_norm import decompose_forward, has_training_batch_norm
from ..passes.clipping import Clip
from ..training import batch_size as batching
from ..training import build_train_step
from ..training import context_parallel as cp_lib
from ..training import embedding_parallel as ep_lib
from ..training.tensor_parallel import trained_names
from . import state as held
from .plan import RunPlan
from .stage_budget import first_fitting

_LOG = logging.getLogger("raf_dist")


def describe(policy: Any) -> str:
    """A budget's recomputation point in words (passes/remat.py)."""
    if isinstance(policy, remat.Cheapest):
        return "none" if policy.count == 0 else f"{policy.count} of selective's values"
    return f"{policy.count} blocks as full, the rest selective"


@dataclasses.dataclass(frozen=True)
class StepIR:
    """The training step at the captured batch size: its IR, signature and recomputation."""

    ir: Any  # the IRModule with "train_step"
    signature: Any  # its TrainStepSignature
    recompute: Any  # the recomputation policy it was built with


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """A rank's captured step with everything but the compiled artifact: its IR, the
    gradient buckets, the StateLayout of what the rank holds and the passes every batch size
    compiles with (``plan_step`` returns it; ``CompiledStep`` adds the artifact)."""

    step: StepIR
    grad_buckets: List[Any]
    layout: Any  # raf_dist.layout.StateLayout
    passes: List[Any]


@dataclasses.dataclass(frozen=True)
class CompiledStep(PlannedStep):
    """The planned step compiled at the captured size."""

    compiled: Any  # compiler.CompiledStep


class SPMDBuilder:
    """Builds this rank's steps (module docstring) from ``model``, ``plan`` and the options."""

    def __init__(self, model: Any, loss: str, optimizer: Any, plan: RunPlan, mesh: Any,
                 comm: Any, device: Any, target: Any, *, compute_dtype: Optional[str],
                 loss_scale: bool, nonfinite: str, max_grad_norm: Optional[float],
                 grad_reduce_dtype: str, cache_dir: Any, dp_rank: int) -> None:
        self.plan, self.parallel, self.mesh, self.comm = plan, plan.layout, mesh, comm
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.device, self.target, self.compute_dtype = device, target, compute_dtype
        self.loss_scale, self.nonfinite, self.cache_dir = loss_scale, nonfinite, cache_dir
        self.max_grad_norm, self.dp_rank = max_grad_norm, dp_rank
        layout = self.parallel
        # gradients travel in grad_reduce_dtype only where they travel (dp > 1)
        self.reduce_dtype = (grad_reduce_dtype if grad_reduce_dtype != "float32"
                             and layout.data_parallel and layout.grad_world > 1 else None)
        # ranks may hold different numbers of rows, and microbatches (gradient accumulation,
        # DESIGN.md 3c at P = 1) too: each weights its loss by rows (training/batch_size.py)
        self.weighted_loss = ((layout.data_parallel and layout.grad_world > 1)
                              or layout.microbatches > 1)
        self.tp_plan: Any = None
        self.ep_plan: Any = None
        self.cp_split: Optional[cp_lib.SequenceSplit] = None
        self.check_ids: Any = None
        self.clip: Optional[Clip] = None
        # no communicator: planning (plan_step), rank 0's pieces as shapes, nothing sent
        self.planning = comm is None

    # ---- the model this rank computes with (MPI: broadcasts of initial values) --------------
    def split(self, tensor_parallel_plan: Any, embedding_plan: Any) -> Any:
        """This rank's model: its tp piece, its rows of the sharded tables, its tokens of
        the sequence; and the clip."""
        layout = self.parallel
        if layout.cp > 1:  # what cp cannot split is refused before the tp split's broadcast
            cp_lib.check_model(self.model, layout.cp, layout.context_parallel_method)
        self.model = self.split_for_tp(self.model, tensor_parallel_plan)
        self.model = self.split_for_embeddings(self.model, embedding_plan)
        if layout.cp > 1:
            self.model, plan = cp_lib.split_model(self.model, layout.cp,
                                                  layout.context_parallel_method)
            self.cp_split = cp_lib.SequenceSplit(plan, layout.cp_rank)
        if layout.sequence_parallel:  # between the tp blocks, 1/tp of the sequence
            self.model = cp_lib.sequence_parallel_model(self.model, layout.tp)
        self.clip = self.make_clip()
        return self.model

    def split_for_tp(self, model: Any, tensor_parallel_plan: Any) -> Any:
        """This rank's tp piece of ``model`` (a broadcast over the world), or ``model``."""
        tp = self.parallel.tp
        if tp > 1:
            # the tables sharded over the dp ranks stay whole on every tp rank of a dp group
            tables = (ep_lib.table_names(model) if self.parallel.embeddings_sharded else ())
            self.tp_plan, model = held.split_model(model, tp, tensor_parallel_plan, self.loss,
                                                   self.comm, self.mesh.tp_rank,
                                                   keep_whole=tables)
        elif tensor_parallel_plan is not None:
            raise ValueError("tensor_parallel_plan needs tensor_parallel_size > 1; set "
                             "dist.get_config().tensor_parallel_size first")
        return model

    def split_for_embeddings(self, model: Any, embedding_plan: Any) -> Any:
        """This rank's model with the embedding tables sharded over the dp group (dp rank
        0's tables broadcast), or ``model``; the ids check of each step."""
        mode = self.parallel.embedding_parallel
        if embedding_plan is not None and mode != "table":
            raise ValueError("embedding_plan places whole tables on ranks: it needs "
                             "dist.get_config().embedding_parallel = 'table' (got "
                             f"{mode!r})")
        if not self.parallel.embeddings_sharded:
            return model
        self.ep_plan = ep_lib.make_plan(model, mode, self.parallel.grad_world, embedding_plan)
        if self.planning:
            lean = model.without_values()
            return ep_lib.shard_model(lean, self.ep_plan, self.dp_rank, lean.init_params,
                                      values=False)
        full = {}
        for name in model.param_names:  # dp rank 0's tables, as DDP starts from rank 0's
            value = np.ascontiguousarray(model.init_params[name])
            full[name] = (collectives.broadcast(value.copy(), root=0, group=self.mesh.dp_group)
                          if name in self.ep_plan.shapes else value)
        self.check_ids = ep_lib.IdsCheck(self.ep_plan, model.without_values().at_batch,
                                         len(model.input_specs))  # shapes only: one copy
        return ep_lib.shard_model(model, self.ep_plan, self.dp_rank, full)

    def embedding_group(self) -> Any:
        """The dp group the tables are sharded over, or None."""
        return self.mesh.dp_group if self.ep_plan is not None else None

    def make_clip(self) -> Optional[Clip]:
        """Clipping's view of the trained parameters (passes/clipping.py): which are
        tensor-parallel pieces; None without ``max_grad_norm``."""
        if self.max_grad_norm is None:
            return None
        split = set(self.tp_plan.placements) if self.tp_plan is not None else set()
        tables = set(self.ep_plan.shapes) if self.ep_plan is not None else set()
        names = trained_names(self.model)
        return Clip(float(self.max_grad_norm), tuple(n in split for n in names),
                    local=tuple(n in tables for n in names))

    # ---- the step's IR ------------------------------------------------------------------------
    def step_model(self, model: Any) -> Any:
        """``model`` as the step differentiates it (batch norm decomposed when synchronized)."""
        world = self.plan.sync_batch_norm_world
        if world > 1 and has_training_batch_norm(model.mod):
            return decompose_forward(model, world)
        return model

    def build_step(self) -> StepIR:
        """The training step's IR and signature at the captured batch size, checked."""
        step_model = self.step_model(self.model)
        if self.plan.activation_memory_budget_mb is not None:
            recompute, (ir, signature) = self.recompute_within_budget(step_model)
        else:
            recompute = self.plan.activation_checkpointing
            ir, signature = build_train_step(step_model, self.loss, self.optimizer,
                                             **self.step_options(recompute))
        batching.check_target_splits(signature.target_spec, self.model.batch_size,
                                     self.parallel.microbatches, self.model.source)
        return StepIR(ir, signature, recompute)

    def recompute_within_budget(self, step_model: Any) -> Tuple[Any, Tuple[Any, Any]]:
        """(policy, (step IR, signature)): the least recomputation whose planned step
        temporaries fit activation_memory_budget_mb, planned with this rank's passes (with
        num_microbatches > 1: the microbatches' steps, ``microbatch_peak``), and its step; a
        ValueError naming the smallest reachable peak when none does (before any collective:
        every rank of an SPMD job plans the same step).

        The points (passes/remat.py ``ladder``): from none to "selective", its values one at
        a time, cheapest first (``Cheapest``); from "selective" to "full", its blocks one at a
        time (``FullBlocks``), searched by stage_budget.first_fitting; only points actually
        planned and fitting are chosen, so a step that is not monotone in them costs
        optimality, never the budget.

        With sharded embedding tables each rank's step differs, so a point's peak is the
        largest over the dp group (MPI: one allgather per point planned) and the ladder
        walked is the ranks' common part: the ranks choose one policy, as their fingerprints
        require."""
        budget = float(self.plan.activation_memory_budget_mb or 0)
        peaks: Dict[Any, int] = {}
        builds: Dict[Any, Any] = {}
        # (planning: rank 0's step alone, with no communicator to agree over)
        agreeing = (self.ep_plan is not None and self.parallel.grad_world > 1
                    and not self.planning)
        dp_comm = self.mesh.dp_comm

        def build(policy: Any) -> Any:
            if policy not in builds:
                builds[policy] = build_train_step(step_model, self.loss, self.optimizer,
                                                  **self.step_options(policy))
            return builds[policy]

        def fits(policy: Any) -> bool:  # with microbatches, the microbatches' steps run
            if policy not in peaks:
                peaks[policy] = (self.microbatch_peak(policy)
                                 if self.parallel.microbatches > 1 else
                                 plan_memory(build(policy)[0], self.passes(), self.target))
                if agreeing:
                    peaks[policy] = max(dp_comm.allgather(peaks[policy]))
            return peaks[policy] <= budget * 2**20

        none = remat.Cheapest(0)
        found = none if fits(none) else None
        if found is None:
            values, blocks = build(none)[1].recompute_ladder
            if agreeing:  # the same points on every rank: the ladders' common part
                ladders = dp_comm.allgather((values, blocks))
                values, blocks = min(v for v, _ in ladders), min(b for _, b in ladders)
            found = first_fitting(
                [[remat.Cheapest(i) for i in range(values + 1)],
                 [remat.Cheapest(values)] + [remat.FullBlocks(k) for k in range(1, blocks + 1)]],
                fits)
        if found is None:
            best = min(peaks, key=lambda p: peaks[p])
            raise ValueError(
                f"activation_memory_budget_mb={budget:g}: the step's planned temporaries cannot "
                f"fit; the smallest reachable is {peaks[best] / 2**20:.3g} MB (recomputation "
                f"{describe(best)}; none {peaks[none] / 2**20:.3g} MB). Raise the "
                "budget, lower the batch per rank, or split the model further "
                "(tensor_parallel_size, ZeRO-3)")
        _LOG.info("activation_memory_budget_mb=%g: recomputation %s (planned temporaries "
                  "%.1f MB; %d points planned)", budget, describe(found),
                  peaks[found] / 2**20, len(peaks))
        return (None if found == none else found), build(found)

    def microbatch_peak(self, policy: Any) -> int:
        """With num_microbatches > 1 the steps that run are the microbatches' (gradient
        accumulation): the planned temporaries of the largest microbatch's partial and final
        steps under recomputation ``policy``, the larger of the two."""
        rows = batching.microbatches(self.model.batch_size, self.parallel.microbatches)[0]
        model = self.model.at_batch(rows)
        return max(plan_memory(self.step_at(model, kind, policy)[0],
                               self.passes(local=kind == "partial"), self.target)
                   for kind in ("partial", "final"))

    def step_at(self, model: Any, kind: Optional[str], recompute: Any) -> Tuple[Any, Any]:
        """(IR, signature) of the step of ``model`` (this rank's piece, at any batch size)
        with recomputation ``recompute``; ``kind``: None, or "partial" / "final" for the
        microbatches of gradient accumulation."""
        return build_train_step(self.step_model(model), self.loss, self.optimizer,
                                accumulate=kind, **self.step_options(recompute))

    def step_options(self, recompute: Any) -> Dict[str, Any]:
        """build_train_step's arguments from the plan (every batch size's step alike), with
        the recomputation policy ``recompute``."""
        layout = self.parallel
        return dict(nonfinite_guard=self.nonfinite_guard(), loss_weight=self.weighted_loss,
                    tensor_parallel=layout.tp > 1, compute_dtype=self.compute_dtype,
                    reduce_dtype=self.reduce_dtype, loss_scale=self.loss_scale,
                    # under ZeRO the distribution pass clips the shards (passes)
                    clip=None if layout.sharded_update else self.clip,
                    recompute=recompute,
                    # plain SGD updates a sharded table's looked-up rows only (on the host:
                    # runtime/embedding_update.py)
                    local_grads=((tuple(self.ep_plan.names), layout.grad_world, self.on_host())
                                 if self.ep_plan is not None else None),
                    low_copies=self.holds_low_copies())

    def holds_low_copies(self) -> bool:
        """Whether the steps read 16-bit copies of the weights held between steps and written
        by the update (build_train_step's ``low_copies``): under mixed precision, not under
        ZeRO (its sharded update and gathers keep the casts in the step)."""
        return self.compute_dtype is not None and not self.parallel.sharded_update

    def on_host(self) -> bool:
        return bool(self.device.dlpack_device_type() == tvm.cpu().dlpack_device_type())

    def nonfinite_guard(self) -> Any:
        """What the step checks before it updates (``nonfinite_guard``)."""
        return nonfinite_guard(self.parallel.zero, self.parallel.grad_world, self.nonfinite)

    def guard_under_zero(self) -> bool:
        """ShardZeRO's guard (every rank's gradients finite before any update): asked for
        by nonfinite="skip", and needed by loss scaling (an overflow is skipped)."""
        return self.nonfinite == "skip" or self.loss_scale

    def passes(self, local: bool = False) -> List[Any]:
        """The plan as explicit pass arguments. ``local``: for a step without gradient
        collectives (the microbatches before the last)."""
        layout, mesh = self.parallel, self.mesh
        reduce = layout.data_parallel and not local
        clip = self.clip if reduce and layout.zero_level > 0 else None
        return step_passes(layout.zero_level if reduce else 0,
                           layout.grad_world if reduce else 1,
                           self.plan.bucket_bytes, overlap=self.plan.overlap_comm,
                           group=mesh.grad_group, guard=self.guard_under_zero(),
                           tp_group=mesh.tp_group if layout.tp > 1 else None,
                           sync_batch_norm_group=(mesh.dp_group
                                                  if self.plan.sync_batch_norm_world > 1
                                                  else None), clip=clip,
                           embedding_group=self.embedding_group(),
                           cp_group=mesh.cp_group if layout.cp > 1 else None,
                           sp_group=mesh.tp_group if layout.sequence_parallel else None)

    # ---- compiling ----------------------------------------------------------------------------
    def planned(self, step: StepIR) -> PlannedStep:
        """``step`` with its gradient buckets, the StateLayout of what this rank holds of the
        parameters and optimizer state (raf_dist.layout) and the passes every batch size
        compiles with: everything but the compiled artifact (no MPI)."""
        layout, signature = self.parallel, step.signature
        # gradient buckets (parameter indices, in backward order) the distribution pass uses
        buckets = (gradient_buckets(step.ir, self.plan.bucket_bytes)
                   if layout.data_parallel else [])
        tables = set(self.ep_plan.shapes) if self.ep_plan is not None else set()
        # what this rank holds of the parameters and optimizer state (raf_dist.layout); the
        # trained parameters it holds alone (its rows of the sharded tables) whole under ZeRO
        held_layout = state_layout(
            signature.param_names, signature.param_specs, signature.state_names,
            layout.zero, layout.grad_world, self.dp_rank, buckets,
            row_states=signature.row_states,
            local=[i for i, n in enumerate(signature.param_names) if n in tables],
            sparse=[signature.param_names.index(n) for n in signature.sparse_names])
        return PlannedStep(step, buckets, held_layout, self.passes())

    def compile_captured(self, step: StepIR) -> CompiledStep:
        """The planned step compiled at the captured size (MPI under data parallelism: the
        compile barrier of ``compile``)."""
        planned = self.planned(step)
        return CompiledStep(step, planned.grad_buckets, planned.layout, planned.passes,
                            self.compile(step.ir, planned.passes))

    def compile(self, ir: Any, passes: List[Any]) -> Any:
        """Under data parallelism every rank builds the same Trainer and compiles the same IR
        (it is SPMD), so on each host local rank 0 compiles into the cache and the other ranks
        load the artifact instead of repeating the work (MPI: a barrier). Without data
        parallelism a Trainer is a local object and compiles on its own."""
        if not self.parallel.spmd:
            return compile_step(ir, passes=passes, target=self.target, cache_dir=self.cache_dir)
        if self.comm.local_rank == 0:
            compiled = compile_step(ir, passes=passes, target=self.target,
                                    cache_dir=self.cache_dir)
            self.comm.idle_barrier("the barrier after local rank 0 compiled the step")
            return compiled
        self.comm.idle_barrier("the barrier after local rank 0 compiled the step")
        return compile_step(ir, passes=passes, target=self.target, cache_dir=self.cache_dir)

    def variant_step(self, built: Any, model: Any, rows: int,
                     kind: Optional[str]) -> Tuple[Any, Any, List[Any]]:
        """(IR, signature, passes) of the step for ``rows`` rows of ``model`` (captured again
        at that size and differentiated; ``built``: the captured step, planned or compiled):
        the same parameter, state and buffer arguments as the captured step. ``kind``:
        "partial" / "final" for the microbatches of gradient accumulation."""
        ir, signature = self.step_at(model, kind, built.step.recompute)
        batching.check_same_state(built.step.signature, signature, rows)
        if (self.parallel.data_parallel and kind != "partial"
                and gradient_buckets(ir, self.plan.bucket_bytes) != built.grad_buckets):
            raise ValueError(f"the step for batch size {rows} groups the gradients into other "
                             "buckets than the captured step; its collectives would not match "
                             "the other ranks'. Use the captured batch size")
        return ir, signature, built.passes if kind != "partial" else self.passes(local=True)

    def compile_variant(self, built: CompiledStep, model: Any, rows: int,
                        kind: Optional[str]) -> Tuple[Any, Any]:
        """(signature, compiled) of ``variant_step``'s step (local work, no barrier)."""
        ir, signature, passes = self.variant_step(built, model, rows, kind)
        return signature, compile_step(ir, passes=passes, target=self.target,
                                       cache_dir=self.cache_dir)

    def vm(self, compiled: Any) -> Any:
        """A relax.VirtualMachine of ``compiled`` on this rank's device."""
        return relax.VirtualMachine(compiled.executable, self.device)


def planning_builder(model: Any, loss: str, optimizer: Any, plan: RunPlan, *,
                     groups: Optional[Dict[str, int]] = None, target: Any = None,
                     tensor_parallel_plan: Any = None, embedding_plan: Any = None,
                     compute_dtype: Optional[str] = None, loss_scale: bool = False,
                     nonfinite: str = "raise", max_grad_norm: Optional[float] = None,
                     grad_reduce_dtype: str = "float32") -> SPMDBuilder:
    """The builder of rank ``plan.layout.rank``'s Trainer with no communicator, its model
    split (for tp and the sharded tables, as shapes). ``groups``: the process-group id of
    each axis the passes embed (default: the world group, 0); ``target``: what the
    recomputation budget plans for (default: the host). One difference from a Trainer, for
    want of the other ranks: with sharded tables and ``activation_memory_budget_mb`` the
    Trainer agrees on the largest peak over the dp group, the plan takes this rank's."""
    mesh = ProcessMesh(plan.layout, groups if groups is not None
                       else {axis: 0 for axis in ("tp", "dp", "pp", "cp", "grad")})
    builder = SPMDBuilder(model, loss, optimizer, plan, mesh, None, tvm.cpu(),
                          target if target is not None else tvm.target.Target("llvm"),
                          compute_dtype=compute_dtype, loss_scale=loss_scale,
                          nonfinite=nonfinite, max_grad_norm=max_grad_norm,
                          grad_reduce_dtype=grad_reduce_dtype, cache_dir=None,
                          dp_rank=plan.layout.dp_rank)
    builder.split(tensor_parallel_plan, embedding_plan)
    return builder


def plan_step(model: Any, loss: str, optimizer: Any, plan: RunPlan,
              **options: Any) -> PlannedStep:
    """Rank ``plan.layout.rank``'s captured step as its Trainer builds it (its IR with the
    recomputation the plan chooses, its passes and StateLayout), nothing compiled;
    ``options``: ``planning_builder``'s."""
    builder = planning_builder(model, loss, optimizer, plan, **options)
    return builder.planned(builder.build_step())
