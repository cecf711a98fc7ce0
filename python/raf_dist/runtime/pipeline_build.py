"""Building the pipeline executor's stages and update, apart from running them (DESIGN.md
section 2, runtime/).

``PipelineBuilder`` takes the model, the run's plan (its ``ParallelLayout``) and the options,
and builds: this rank's tp piece of the model, the stage plan (passes/stage_partition.py: cut
on the forward at the captured microbatch size), this rank's stages compiled per microbatch
size (``stage_set``: training/pipeline_step.py's stage functions, each with its
recomputation, chosen under ``activation_memory_budget_mb`` by runtime/stage_budget.py) and
the compiled update (the dp / ZeRO-1 pass over the dp group). The artifacts are ``_Stage``
and ``StageSet``; runtime/pipeline_executor.py runs them.

MPI in construction (marked): the tp split broadcasts world rank 0's initial values, and the
budget's choice is agreed over the world (stage_budget.choose_on_every_rank).

With no communicator the builder plans (proxies/extract.py reads it): the split as shapes,
the stage plan, ``stage_ir`` of any stage and the update's IR and passes; nothing compiled,
and no recomputation budget (each stage's level is the caller's).
"""
import dataclasses
import logging
from typing import AbstractSet, Any, Dict, List, Optional, Set, Tuple

from tvm import relax

from ..compiler import compile_step
from ..compiler.step_passes import function_passes, step_passes
from ..layout import stage_rank, state_layout
from ..passes import gradient_buckets
from ..passes.auto_cast import auto_cast
from ..passes.batch_norm import decompose_forward, has_training_batch_norm
from ..passes.clipping import Clip
from ..passes.context_parallel import LowerContextParallel
from ..passes.sequence_parallel import LowerSequenceParallel
from ..passes.lower_allreduce import LowerAllReduce
from ..passes.stage_partition import ForwardGraph, partition, plan_like
from ..passes.stage_split import split_forward
from ..passes.tp_ops import LowerTensorParallel
from ..training import batch_size as batching
from ..training import context_parallel as cp_lib
from ..training import pipeline_schedule as schedules
from ..training.pipeline_step import build_stage_functions, build_update_step, type_spec
from . import metrics as metrics_lib
from . import stage_budget
from . import state as held
from .plan import RunPlan

_LOG = logging.getLogger("raf_dist")


@dataclasses.dataclass
class _Stage:
    index: int
    functions: Any  # training.pipeline_step.StageFunctions
    vm: Dict[str, Any]  # name -> VM function
    planned_peak_bytes: int
    machine: Any = None  # the relax.VirtualMachine (profile instruments it)


@dataclasses.dataclass
class StageSet:
    """This rank's stages compiled for microbatches of ``rows`` rows (one set per microbatch
    size seen, as the Trainer keeps one step per batch size), and the boundary messages'
    (shape, dtype) at that size."""

    rows: int
    stages: Dict[int, _Stage]  # stage index -> _Stage
    boundary_specs: List[Any]
    flops: Optional[int] = None  # one microbatch through these stages (metrics)
    buffer_holders: Optional[Dict[str, int]] = None  # buffer -> the pp rank writing it


class PipelineBuilder:
    """Builds this rank's stages and update (module docstring)."""

    def __init__(self, model: Any, loss: str, optimizer: Any, plan: RunPlan, mesh: Any,
                 comm: Any, device: Any, target: Any, *, compute_dtype: Optional[str],
                 loss_scale: bool, max_grad_norm: Optional[float], grad_reduce_dtype: str,
                 cache_dir: Any, dp_rank: int, tensor_parallel_plan: Any) -> None:
        self.run_plan, self.parallel, self.mesh, self.comm = plan, plan.layout, mesh, comm
        layout = self.parallel
        self.loss, self.optimizer, self.loss_scale = loss, optimizer, loss_scale
        self._device, self._target, self._cache_dir = device, target, cache_dir
        self.compute_dtype, self.max_grad_norm = compute_dtype, max_grad_norm
        # gradients average over dp, or dp x cp with context parallelism (ParallelLayout)
        self.grad_reduce_dtype, self.dp_rank, self.dp_group = grad_reduce_dtype, dp_rank, \
            mesh.grad_group
        self.bucket_bytes = plan.bucket_bytes
        self.sync_batch_norm_world = plan.sync_batch_norm_world
        self.pp_rank = mesh.pp_rank
        self.num_stages = layout.num_stages
        self.full_model = self.model = model
        self.tp_plan: Any = None
        self.planning = comm is None  # (module docstring)
        if self.planning and plan.activation_memory_budget_mb is not None:
            raise ValueError("a pipeline builder with no communicator has no recomputation "
                             "budget to agree on: give each stage's level instead")
        if layout.cp > 1:  # what cp cannot split is refused before the tp split's broadcast
            cp_lib.check_model(model, layout.cp, layout.context_parallel_method)
        if layout.tp > 1:  # MPI: world rank 0's initial values broadcast
            self.tp_plan, model = held.split_model(model, layout.tp, tensor_parallel_plan, loss,
                                                   comm, mesh.tp_rank)
            self.model = model
        elif tensor_parallel_plan is not None:
            raise ValueError("tensor_parallel_plan needs tensor_parallel_size > 1")
        self.cp_split: Optional[cp_lib.SequenceSplit] = None
        if layout.cp > 1:  # each stage computes this rank's tokens (training/context_parallel)
            self.model, found = cp_lib.split_model(self.model, layout.cp,
                                                   layout.context_parallel_method)
            self.cp_split = cp_lib.SequenceSplit(found, layout.cp_rank)
            model = self.model
        if layout.sequence_parallel:  # between the tp blocks, 1/tp of the sequence
            self.model = model = cp_lib.sequence_parallel_model(model, layout.tp)
        self.batch_size = model.batch_size
        batching.check_target_splits(self.captured_target_spec(), self.batch_size,
                                     layout.microbatches, model.source)
        frozen = self._frozen_names = set(getattr(model, "frozen_params", ()))
        # the stage plan, cut on the forward at the captured microbatch size
        # (synchronized batch norm: each microbatch's statistics over the dp group)
        rows = self.plan_rows = self.batch_size // layout.microbatches
        stage_plan = self.plan = partition(self.forward_graph(rows), self.num_stages,
                                           plan.split_points, ranks=layout.pp)
        self.my_stages = [s for s in range(self.num_stages)
                          if stage_rank(s, layout.pp) == self.pp_rank]
        mine: Set[str] = set().union(*(stage_plan.params[s] for s in self.my_stages))
        self.param_names = [n for n in model.param_names if n in mine and n not in frozen]
        self.frozen_names = [n for n in model.param_names if n in mine and n in frozen]
        self.specs = dict(zip(model.param_names, model.param_specs()))
        self.param_specs = [self.specs[n] for n in self.param_names]
        self._built: Dict[Any, _Stage] = {}  # (rows, stage, selective) -> _Stage, while
        self.actions = schedules.rank_actions(layout.schedule, layout.pp, layout.microbatches,
                                              layout.stages_per_rank)  # choosing
        self.holding_ranks = self.parameter_holders(stage_plan)
        self.build_update(optimizer, cache_dir)  # (its temporaries join the budget's model)
        # {stage: False | "selective" | "full"}: activation_checkpointing's one choice for
        # every stage, or chosen per stage under activation_memory_budget_mb
        self.stage_recompute = self.choose_recomputation(rows)

    def stage_set(self, rows: int) -> StageSet:
        """This rank's stages for microbatches of ``rows`` rows, built (the model captured
        again at that size, cut where the captured plan cuts, compiled): local work."""
        plan = self.plan
        if rows != self.plan_rows:
            _LOG.info("microbatches of %d rows on rank %d (the stages were built for %d): "
                      "compiling this rank's stages for that size", rows, self.comm.rank,
                      self.plan_rows)
            plan = plan_like(self.plan, self.forward_graph(rows))
        funcs = split_forward(plan)
        low = self.low_boundaries(funcs)
        stage_set = StageSet(rows, self.build_stages(funcs, rows, low),
                             self.boundary_specs(funcs, low))
        if rows == self.plan_rows:  # which pp rank writes each buffer (buffers_dict)
            stage_set.buffer_holders = {b: stage_rank(i, self.parallel.pp)
                                        for i, f in enumerate(funcs) for b in f.buffers_written}
        self._built = {}
        return stage_set

    def holders(self) -> Dict[str, int]:
        """{parameter name: the lowest pp rank holding it} from the stage plan."""
        return {name: min(ranks) for name, ranks in self.holding_ranks.items()}

    def build_update(self, optimizer: Any, cache_dir: Any) -> None:
        """The update: this rank's parameters, reduced over dp (ZeRO-1: sharded states), and
        the StateLayout it holds them under."""
        if not self.param_names:
            raise ValueError(f"pipeline rank {self.pp_rank} holds no trainable parameter; use "
                             "fewer stages")
        self.update_ir, passes = self.update_step(self.param_names, optimizer, self.clip())
        self.grad_buckets = (gradient_buckets(self.update_ir, self.bucket_bytes)
                             if self.parallel.data_parallel else [])
        self.layout = state_layout(self.param_names, self.param_specs, optimizer.state_names,
                                   self.parallel.zero, self.parallel.grad_world,
                                   self.dp_rank, self.grad_buckets,
                                   row_states=optimizer.row_states)
        self.compiled_update: Any = None
        if self.planning:
            return
        self.compiled_update = compile_step(self.update_ir, passes=passes, target=self._target,
                                            cache_dir=cache_dir)
        self.update_vm = relax.VirtualMachine(self.compiled_update.executable, self._device)
        self.update_fn = self.update_vm["train_step"]

    def update_step(self, names: List[str], optimizer: Any,
                    clip: Optional[Clip]) -> Tuple[Any, List[Any]]:
        """(IR, passes) of the update of the parameters ``names`` (this rank's; a planning
        builder asks for any pp rank's, from ``self.plan.params``) with clipping ``clip``."""
        sharded = self.parallel.sharded_update  # ShardZeRO clips the shards
        ir = build_update_step(
            names, [self.specs[n] for n in names], optimizer,
            clip=None if sharded else clip,
            reduce_dtype=None if self.grad_reduce_dtype == "float32" else self.grad_reduce_dtype,
            loss_scale=self.loss_scale)
        passes = step_passes(
            self.parallel.zero, self.parallel.grad_world, self.bucket_bytes,
            overlap=self.run_plan.overlap_comm, group=self.dp_group,
            tp_group=self.mesh.tp_group if clip and clip.any_split else None,
            clip=clip if sharded else None)
        if clip is not None:  # the norm's sum over the pp group (passes/clipping.py)
            passes.insert(1, LowerAllReduce(self.mesh.pp_group))
        return ir, passes

    def clip(self) -> Optional[Clip]:
        """The update's clipping (passes/clipping.py), or None: this rank's parameters, the
        tensor-parallel pieces among them, and the tied ones counted by the lowest pp rank
        that holds them only."""
        if self.max_grad_norm is None:
            return None
        split = set(self.tp_plan.placements) if self.tp_plan is not None else set()
        return Clip(float(self.max_grad_norm), tuple(n in split for n in self.param_names),
                    tuple(self.holders()[n] == self.pp_rank for n in self.param_names),
                    across_pp=True)

    def forward_graph(self, rows: int) -> ForwardGraph:
        """The forward at ``rows`` rows per microbatch, read for pipelining (training batch
        norm decomposed first, synchronized over dp with sync_batch_norm)."""
        at_rows = self.model.at_batch(rows)
        if has_training_batch_norm(at_rows.mod):
            at_rows = decompose_forward(at_rows, self.sync_batch_norm_world)
        return ForwardGraph(at_rows.forward, len(at_rows.input_specs),
                            len(at_rows.dropout_specs), at_rows.param_names,
                            list(getattr(at_rows, "buffer_names", ())))

    def boundary_specs(self, funcs: List[Any], low: AbstractSet[int]) -> List[Any]:
        """(shape, dtype) of each stage's output (boundary b: stage b's output, stage b + 1's
        input), in the compute dtype where ``low`` says it travels in it."""
        specs = [type_spec(f.output_type) for f in funcs]
        return [(shape, self.compute_dtype if b in low else dtype)
                for b, (shape, dtype) in enumerate(specs)]

    def messages(self, specs: List[Any],
                 input_specs: Dict[int, Any]) -> stage_budget.Messages:
        """runtime/stage_budget.py's Messages: the boundaries of ``specs`` (every stage's
        output: the last stage's is no message) and {stage: its input spec}."""
        return stage_budget.Messages(specs[:self.num_stages - 1],
                                     {s: spec for s, spec in input_specs.items() if s > 0})

    def low_boundaries(self, funcs: List[Any]) -> Set[int]:
        """Under mixed precision, the stage boundaries b (stage b's output, stage b + 1's one
        input) whose activation travels in the compute dtype: every float32 one."""
        if self.compute_dtype is None:
            return set()
        low = set()
        for b in range(len(funcs) - 1):
            nxt = funcs[b + 1]
            if (str(funcs[b].output_type.dtype) == "float32" and nxt.num_inputs == 1
                    and str(nxt.function.params[0].ty.dtype) == "float32"):
                low.add(b)
        return low

    def build_stages(self, funcs: List[Any], rows: int,
                     low: AbstractSet[int] = frozenset()) -> Dict[int, _Stage]:
        """{stage index: _Stage} of this rank's stages (``funcs``: split_forward's functions
        at ``rows`` rows per microbatch), compiled, each with its recomputation
        (``stage_recompute``); ``low``: the boundaries whose activation travels in the
        compute dtype (``_low_boundaries``)."""
        return {s: self.build_stage(s, funcs, rows, low,
                                     self.stage_recompute[s] == "selective")
                for s in self.my_stages}

    def build_stage(self, s: int, funcs: List[Any], rows: int, low: AbstractSet[int],
                    selective: bool) -> _Stage:
        """Stage ``s`` compiled (``selective``: its forward keeps what "selective" keeps)."""
        key = (rows, s, selective)
        if key in self._built:
            return self._built[key]
        fns, passes = self.stage_ir(s, funcs, rows, low, selective)
        compiled = compile_step(fns.mod, passes=passes, target=self._target,
                                cache_dir=self._cache_dir)
        vm = relax.VirtualMachine(compiled.executable, self._device)
        stage = self._built[key] = _Stage(
            s, fns, {k: vm[k] for k in ("forward", "backward", "recompute", "forward_only")},
            compiled.planned_peak_bytes, vm)
        return stage

    def stage_ir(self, s: int, funcs: List[Any], rows: int, low: AbstractSet[int],
                 selective: bool) -> Tuple[Any, List[Any]]:
        """(StageFunctions, passes) of stage ``s`` of ``funcs`` at ``rows`` rows per
        microbatch: its forward, backward and recomputation functions and the passes they
        compile with (any stage: a planning builder reads every rank's)."""
        passes: List[Any] = []  # no gradient collective here: the update reduces over dp
        if self.parallel.tp > 1:
            passes.append(LowerTensorParallel(self.mesh.tp_group))
        if self.parallel.cp > 1:  # ring / all-to-all attention on the cp group
            passes.append(LowerContextParallel(self.mesh.cp_group))
        if self.parallel.sequence_parallel:  # its scatters and gathers on the tp group
            passes.append(LowerSequenceParallel(self.mesh.tp_group))
        if self.sync_batch_norm_world > 1:  # the statistics' allreduce ops, after autodiff
            passes.append(LowerAllReduce(self.dp_group))
        passes += function_passes()
        last = s == self.num_stages - 1
        forward = funcs[s].function
        if self.compute_dtype is not None:
            forward = auto_cast(forward, self.compute_dtype, low_output=s in low)
        fns = build_stage_functions(
            s, last, forward, funcs[s].mask_indices, funcs[s].param_names,
            self._frozen_names, self.loss,
            target_spec=batching.batched_target_spec(self.captured_target_spec(), rows,
                                                     self.batch_size) if last else None,
            vocab_parallel=getattr(self.model, "output_split_classes", 0) > 1,
            buffer_names=funcs[s].buffer_names, buffers_written=funcs[s].buffers_written,
            selective=selective, low_precision=self.compute_dtype is not None)
        return fns, passes

    def choose_recomputation(self, rows: int) -> Dict[int, Any]:
        """{stage: recomputation} for this rank's stages: activation_checkpointing's for
        all, or under activation_memory_budget_mb the least per stage whose modelled
        activation memory fits (runtime/stage_budget.py; the stages compiled while choosing
        are kept for the first stage set). A budget no choice meets raises on every rank."""
        budget = self.run_plan.activation_memory_budget_mb
        if budget is None:  # the plan's policy: None, "full" or "selective"
            return {s: self.run_plan.activation_checkpointing or False for s in self.my_stages}
        funcs = split_forward(self.plan)
        low = self.low_boundaries(funcs)

        def measure(s: int, level: Any) -> Any:
            stage = self.build_stage(s, funcs, rows, low, level == "selective")
            return stage_budget.saved_bytes(stage.functions, level), stage.planned_peak_bytes

        inputs = {s: type_spec(funcs[s].function.params[0].ty) for s in self.my_stages}
        timeline = stage_budget.held_timeline(
            self.actions[self.pp_rank], self.my_stages,
            self.messages(self.boundary_specs(funcs, low), inputs))
        chosen = stage_budget.choose_on_every_rank(
            self.comm, self.my_stages, timeline, measure, int(budget * 2**20),
            self.compiled_update.planned_peak_bytes)
        _LOG.info("activation_memory_budget_mb=%g on pp rank %d: recomputation %s",
                  budget, self.pp_rank, chosen)
        return chosen

    def captured_target_spec(self) -> Any:
        """The target's spec at the captured batch (from the full model's output; under
        context parallelism from this rank's tokens')."""
        model = self.model if self.cp_split is not None else self.full_model
        out = model.forward.ret_ty
        if getattr(model, "buffer_names", ()):  # (output, *new buffer values)
            out = out.fields[0]
        shape = [int(d) for d in out.shape]
        if self.loss == "cross_entropy":
            return tuple(shape[:-1]), "int64"
        return tuple(shape), str(out.dtype)

    def parameter_holders(self, stage_plan: Any) -> Dict[str, Set[int]]:
        """{parameter name: the pp ranks whose stages read it}."""
        holders: Dict[str, Set[int]] = {}
        for s in range(self.num_stages):
            for name in stage_plan.params[s]:
                holders.setdefault(name, set()).add(stage_rank(s, self.parallel.pp))
        return holders

    def tied_parameters(self) -> List[str]:
        """The trained parameters held on more than one pp rank (tied embeddings), sorted:
        their gradients are summed over the pp group before the update."""
        return sorted(n for n, ranks in self.holding_ranks.items()
                      if len(ranks) > 1 and n not in self._frozen_names)

    def modelled_activation_bytes(self, stage_set: StageSet) -> Any:
        """runtime/stage_budget.py's model of this rank's activation memory at the captured
        microbatch size: (saved values and boundary messages at their peak, the whole model:
        what activation_memory_budget_mb is held to)."""
        stages = stage_set.stages
        messages = self.messages(stage_set.boundary_specs,
                                 {s: st.functions.input_specs[0] for s, st in stages.items()})
        timeline = stage_budget.held_timeline(self.actions[self.pp_rank], self.my_stages,
                                              messages)
        saved = {s: stage_budget.saved_bytes(st.functions, self.stage_recompute[s])
                 for s, st in stages.items()}
        return (stage_budget.modelled_peak(timeline, saved, {}),
                stage_budget.modelled_peak(timeline, saved,
                                           {s: st.planned_peak_bytes for s, st in stages.items()},
                                           self.compiled_update.planned_peak_bytes))

    @staticmethod
    def stage_flops(stage_set: StageSet) -> int:
        """FLOPs of one microbatch through this rank's stages: forward and backward (a
        recomputed forward is not counted: MFU counts the model's FLOPs)."""
        if stage_set.flops is None:
            stage_set.flops = sum(metrics_lib.function_flops(st.functions.mod[name])
                                  for st in stage_set.stages.values()
                                  for name in ("forward", "backward"))
        return stage_set.flops
