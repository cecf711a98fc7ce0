"""The pipeline-parallel Trainer: stages on the pp axis of the mesh, a schedule executed with
tagged asynchronous point-to-point messages (DESIGN.md section 3c).

``raf_dist.Trainer`` runs a ``PipelineExecutor`` when ``pipeline_parallel_size`` > 1. Every
rank captures the same model, cuts it into S stages (passes/pipeline.py: markers, named split
points or the cost partitioner), builds and compiles the functions of the stages it holds
(training/pipeline.py: forward, backward, recompute, forward_only) at the microbatch's rows
and one update function over its parameters, with the data-parallel / ZeRO-1 pass over the dp
group. A step then runs this rank's action list (training/pipeline_schedule.py):

- every receive of the step is posted first (``Irecv`` into a buffer of the boundary's
  shape, tagged by microbatch, stage boundary and direction), sends are ``Isend`` and waited
  at the end of the step, so whatever order the schedule asks for nothing can deadlock on a
  message, and a rank's compute overlaps its neighbours' transfers;
- ``F(s, m)`` runs stage s's forward on microbatch m (rows ``m*r .. (m+1)*r`` of this rank's
  data-parallel slice) and keeps the values its backward needs (only the stage input with
  ``activation_checkpointing`` True / "full"; with "selective" the matmul and convolution
  outputs, the backward recomputing the cheap rest); the last stage's forward gives the
  microbatch's mean loss;
- ``B(s, m)`` runs the backward with the gradient received from stage s + 1 (on the last
  stage: the microbatch's share of the global batch, ``rows_m * dp / global rows``, so the
  loss is a mean over rows, not a mean of means) and adds the parameter gradients into the
  rank's accumulators;
- buffers (BatchNorm's running statistics) live on the stage whose function updates them:
  its ``F`` takes their current values and returns the new ones (once per microbatch, in
  order); after the update dp rank 0's are broadcast over dp (DDP's ``broadcast_buffers``);
- ``UPDATE``: a parameter held by several stages on different ranks (tied embeddings) has its
  accumulated gradient summed over those ranks; then the compiled update (gradients averaged
  over dp, ZeRO-1 shards) runs once. The loss, known on the last stage, is broadcast over pp.

MPI carries the point-to-point messages from host (numpy) buffers: for CUDA tensors this
stages through the host (an NCCL send/recv path is not built).
"""
import dataclasses
import logging
import math
import time
from typing import Optional

import numpy as np
import tvm
from tvm import relax

from .. import checkpoint as ckpt
from .. import process_memory
from .. import device as device_lib
from .. import profiler
from ..compiler import compile_step
from ..compiler.step_passes import forward_passes, function_passes, step_passes
from ..distributed import collectives
from ..distributed.communicator import raised_on_every_rank
from ..layout import stage_rank, state_layout
from ..passes import gradient_buckets
from ..passes.pipeline import ForwardGraph, partition, plan_like, split_forward
from ..passes.auto_cast import auto_cast
from ..passes.batch_norm import decompose_forward, has_training_batch_norm
from ..passes.clipping import Clip
from ..passes.lower_allreduce import LowerAllReduce
from ..passes.tp_ops import LowerTensorParallel
from ..training import batch_size as batching
from ..training import pipeline_schedule as schedules
from ..training.loss import check_targets, num_classes
from ..training.pipeline import build_stage_functions, build_update_step, type_spec
from ..training.step import GRAD_UNSCALE, TrainStepSignature, hyper_arguments
from . import agreement, batches
from . import predict as predict_lib
from . import state as held
from . import metrics as metrics_lib
from . import mixed_precision, stage_budget
from .loop import LoopScalars
from .loss_scale import LossScaler
from .plan import RunPlan
from .schedule_run import ScheduleRun
from .tensors import bytes_by_dtype, check_array, nbytes
from .transport import PipelineTransport

_LOG = logging.getLogger("raf_dist")


@dataclasses.dataclass
class _Stage:
    index: int
    functions: object  # training.pipeline.StageFunctions
    vm: dict  # name -> VM function
    planned_peak_bytes: int
    machine: object = None  # the relax.VirtualMachine (profile instruments it)


@dataclasses.dataclass
class _StageSet:
    """This rank's stages compiled for microbatches of ``rows`` rows (one set per microbatch
    size seen, as the Trainer keeps one step per batch size), and the boundary messages'
    (shape, dtype) at that size."""

    rows: int
    stages: dict  # stage index -> _Stage
    boundary_specs: list
    flops: Optional[int] = None  # one microbatch through these stages (metrics)


class PipelineExecutor(LoopScalars):
    """The executor for ``pipeline_parallel_size`` > 1 (module docstring): the whole Trainer
    surface over this rank's stages (``profile``, ``buffers_dict``, ``predict``,
    checkpoints, any batch size of at least ``num_microbatches`` rows)."""

    def __init__(self, model, loss, optimizer, device, plan: RunPlan, mesh, comm,
                 cache_dir=None, seed=0, nonfinite="raise", tensor_parallel_plan=None,
                 precision="fp32", grad_reduce_dtype="float32", lr_schedule=None,
                 log_every=0, max_grad_norm=None):
        """See raf_dist.Trainer: the arguments are checked, the pipeline config too
        (``check_pipeline_config``) and the ranks agreed (the front did all three)."""
        self.run_plan, self.config, self.comm, self.mesh = plan, plan.config, comm, mesh
        self.local = False
        self.precision, self.grad_reduce_dtype = precision, grad_reduce_dtype
        # bf16 / fp16: each stage's forward cast by AutoCast, its activation in and out in
        # the low dtype; fp16 scales the last stage's seeds (every gradient with them)
        self.compute_dtype = mixed_precision.compute_dtype(precision, device)
        self._scaler = LossScaler() if precision == "fp16" else None
        self.pp, self.tp, self.zero_level = plan.pp, plan.tp, plan.zero_level
        self.schedule = plan.schedule
        self.stages_per_rank = plan.stages_per_rank
        self.num_stages = schedules.num_stages(self.schedule, self.pp, self.stages_per_rank)
        self.microbatches = plan.microbatches
        self.nonfinite = nonfinite
        self.max_grad_norm, self._last_grad_norm = max_grad_norm, None
        self.data_parallel, self.world, self.spmd = plan.data_parallel, plan.world, True
        self.dp_group, self.dp_comm = mesh.dp_group, mesh.dp_comm
        self.dp_rank = mesh.dp_rank if self.world > 1 else 0
        self.pp_rank, self.pp_comm = mesh.pp_rank, mesh.pp_comm
        self.model, self.loss, self.optimizer, self.device = model, loss, optimizer, device
        self._device = device_lib.select(device, comm, collective=True)
        self._target = device_lib.target_for(self._device)
        self.full_model = model
        self.tp_plan = None
        if self.tp > 1:
            self.tp_plan, model = held.split_model(model, self.tp, tensor_parallel_plan, loss,
                                                   comm, mesh.tp_rank)
            self.model = model
        elif tensor_parallel_plan is not None:
            raise ValueError("tensor_parallel_plan needs tensor_parallel_size > 1")
        self._classes = num_classes(self.full_model.forward, loss)
        self.batch_size = model.batch_size
        batching.check_target_splits(self._captured_target_spec(), self.batch_size,
                                     self.microbatches, model.source)
        self._target_per_row = batching.target_rows_per_row(self._captured_target_spec(),
                                                            self.batch_size)
        self.split_points = plan.split_points
        self.activation_checkpointing = plan.activation_checkpointing
        frozen = set(getattr(model, "frozen_params", ()))
        self._frozen_names = frozen
        self.bucket_bytes = plan.bucket_bytes
        self._cache_dir = cache_dir
        self.seed = int(seed)

        # the stage plan, cut on the forward at the captured microbatch size, and this rank's
        # stages compiled at that size (other sizes: _stage_set, the same cuts)
        # synchronized batch norm: each microbatch's statistics over the dp group
        self.sync_batch_norm_world = plan.sync_batch_norm_world
        rows = self._plan_rows = self.batch_size // self.microbatches
        stage_plan = self.plan = partition(self._forward_graph(rows), self.num_stages,
                                           self.split_points, ranks=self.pp)
        self.my_stages = [s for s in range(self.num_stages)
                          if stage_rank(s, self.pp) == self.pp_rank]
        mine = set().union(*(stage_plan.params[s] for s in self.my_stages))
        self.param_names = [n for n in model.param_names if n in mine and n not in frozen]
        self.frozen_names = [n for n in model.param_names if n in mine and n in frozen]
        specs = self._specs = dict(zip(model.param_names, model.param_specs()))
        self.param_specs = [specs[n] for n in self.param_names]
        self._profiling = None  # a profiler.StepProfiler while profile records
        self._stage_sets = {}  # microbatch rows -> _StageSet
        self._built = {}  # (rows, stage, selective) -> _Stage, while recomputation is chosen
        self.actions = schedules.rank_actions(self.schedule, self.pp, self.microbatches,
                                              self.stages_per_rank)
        # {stage: False | "selective" | "full"}: activation_checkpointing's one choice for
        # every stage, or chosen per stage under activation_memory_budget_mb
        self._holding_ranks = self._parameter_holders(stage_plan)
        self._build_update(optimizer, cache_dir)  # (its temporaries join the budget's model)
        self.stage_recompute = self._choose_recomputation(rows)
        self._stage_set(rows)
        self._built = {}
        self.signature = TrainStepSignature(
            input_specs=list(model.input_specs), target_spec=self._captured_target_spec(),
            param_names=self.param_names, param_specs=self.param_specs,
            state_names=list(optimizer.state_names), row_states=list(optimizer.row_states),
            hyper_names=hyper_arguments(optimizer, self.param_names)
            + ([GRAD_UNSCALE] if self._scaler is not None else []),
            frozen_names=self.frozen_names, frozen_specs=[specs[n] for n in self.frozen_names],
            buffer_names=list(getattr(model, "buffer_names", ())),
            buffer_specs=model.buffer_specs() if getattr(model, "buffer_names", ()) else [])
        process_memory.after_compile()  # the compile's transient gone before the states come
        self._init_parameters(model)
        self._tied = self._tied_parameters()
        self.step_count = 0
        self.skipped_steps = 0
        self.lr_schedule, self._last_lr = lr_schedule, None
        self._metrics = metrics_lib.StepMetrics(metrics_lib.tokens_per_row(model.input_specs),
                                                log_every)
        # the last step's F / B actions on this rank: (kind, stage, microbatch, start, end)
        # in time.perf_counter seconds (bench/pipeline.py measures the bubble from them)
        self.last_timeline = []
        self._hyper_dtype = self.param_specs[0][1]
        self._comm_last_step = {}
        self._peak_saved = {s: 0 for s in self.my_stages}
        self._peak_saved_bytes = {s: 0 for s in self.my_stages}
        self._peak_held_bytes = 0  # saved values + boundary messages (ScheduleRun)
        self.transport = PipelineTransport(mesh, self.num_stages, self.microbatches)
        schedules.check_actions(self.actions, self.num_stages, self.microbatches)
        agreement.check_fingerprints(comm, *self.fingerprint())
        self._buffer_tensors = self._init_buffers(model)
        # the parameter tensors hold the values now: the models keep their shapes only (one
        # copy of the weights in the process; Model.without_values)
        lean = self.model.without_values()
        self.full_model = (lean if self.full_model is self.model
                           else self.full_model.without_values())
        self.model = lean
        self._forwards = predict_lib.Forwards(  # predict's compiled forwards by rows
            self.full_model.at_batch, forward_passes(), self._target, self._device, cache_dir,
            self.compute_dtype)  # in the training precision, as the SPMD executor's

    # ---- building --------------------------------------------------------------------------
    def _build_update(self, optimizer, cache_dir):
        """The update: this rank's parameters, reduced over dp (ZeRO-1: sharded states), and
        the StateLayout it holds them under."""
        if not self.param_names:
            raise ValueError(f"pipeline rank {self.pp_rank} holds no trainable parameter; use "
                             "fewer stages")
        clip = self._clip()
        sharded = self.data_parallel and self.zero_level > 0  # ShardZeRO clips the shards
        self.update_ir = build_update_step(
            self.param_names, self.param_specs, optimizer, clip=None if sharded else clip,
            reduce_dtype=None if self.grad_reduce_dtype == "float32" else self.grad_reduce_dtype,
            loss_scale=self._scaler is not None)
        self.grad_buckets = (gradient_buckets(self.update_ir, self.bucket_bytes)
                             if self.data_parallel else [])
        self.layout = state_layout(self.param_names, self.param_specs, optimizer.state_names,
                                   self.zero_level if self.data_parallel else 0, self.world,
                                   self.dp_rank, self.grad_buckets,
                                   row_states=optimizer.row_states)
        passes = step_passes(self.zero_level if self.data_parallel else 0,
                             self.world if self.data_parallel else 1, self.bucket_bytes,
                             overlap=self.run_plan.overlap_comm, group=self.dp_group,
                             tp_group=self.mesh.tp_group if clip and clip.any_split else None,
                             clip=clip if sharded else None)
        if clip is not None:  # the norm's sum over the pp group (passes/clipping.py)
            passes.insert(1, LowerAllReduce(self.mesh.pp_group))
        self.compiled_update = compile_step(self.update_ir, passes=passes, target=self._target,
                                            cache_dir=cache_dir)
        self._update_vm = relax.VirtualMachine(self.compiled_update.executable, self._device)
        self._update_fn = self._update_vm["train_step"]

    def _clip(self):
        """The update's clipping (passes/clipping.py), or None: this rank's parameters, the
        tensor-parallel pieces among them, and the tied ones counted by the lowest pp rank
        that holds them only."""
        if self.max_grad_norm is None:
            return None
        split = set(self.tp_plan.placements) if self.tp_plan is not None else set()
        return Clip(float(self.max_grad_norm), tuple(n in split for n in self.param_names),
                    tuple(self._holders()[n] == self.pp_rank for n in self.param_names),
                    across_pp=True)

    def _init_parameters(self, model):
        """This rank's stages' parameters at world rank 0's initial values (whatever each
        rank's seed; under tensor parallelism split_model broadcast them already) and fresh
        optimizer states."""
        init = {}
        for name in model.param_names:
            value = np.ascontiguousarray(model.init_params[name]).copy()
            if self.tp == 1:  # every rank takes part, whichever stage holds the parameter
                value = collectives.broadcast(value, root=0)
            if name in self.param_names or name in self.frozen_names:
                init[name] = value
        self._tensors = {n: tvm.runtime.tensor(v, self._device) for n, v in init.items()}
        fresh = self.layout.zero_states(self.optimizer.initial_states_by_param(
            self.param_names))
        self._states = [tvm.runtime.tensor(a, self._device) for a in fresh]

    def _init_buffers(self, model):
        """The buffers this rank's stages write (BatchNorm running statistics) at rank 0's
        initial values (every rank takes part in every buffer's broadcast); buffers_dict
        gathers every stage's."""
        written = {b for ss in self._stage_sets.values() for st in ss.stages.values()
                   for b in st.functions.buffers_written}
        tensors = {}
        for name in getattr(model, "buffer_names", ()):
            value = np.array(model.init_buffers[name], order="C")
            collectives.broadcast(value.reshape(-1), root=0)
            if name in written:
                tensors[name] = tvm.runtime.tensor(value, self._device)
        return tensors

    def fingerprint(self):
        """(digest, description) as the SPMD executor's, with the stage plan instead of the
        parameters (each pp rank holds other ones; the agreement at construction compared
        the whole model already)."""
        return agreement.fingerprint(dict(agreement.step_description(self), pipeline={
            "stages": self.num_stages, "cuts": list(self.plan.cuts)}))

    # the surface the SPMD executor has too
    @property
    def num_grad_buckets(self):
        """Collectives per step for gradients (0 without data parallelism)."""
        return len(self.grad_buckets)

    @property
    def update_guarded(self) -> bool:
        """Always: the update runs only once every rank's gradients are known finite."""
        return True

    def dropout_masks(self, step, rows=None, microbatch=None):
        """No masks: pipelining refuses models with dropout (check_pipeline_config)."""
        return []

    def _forward_graph(self, rows):
        """The forward at ``rows`` rows per microbatch, read for pipelining (training batch
        norm decomposed first, synchronized over dp with sync_batch_norm)."""
        at_rows = self.model.at_batch(rows)
        if has_training_batch_norm(at_rows.mod):
            at_rows = decompose_forward(at_rows, self.sync_batch_norm_world)
        return ForwardGraph(at_rows.forward, len(at_rows.input_specs),
                            len(at_rows.dropout_specs), at_rows.param_names,
                            list(getattr(at_rows, "buffer_names", ())))

    def _stage_set(self, rows):
        """This rank's stages for microbatches of ``rows`` rows: built (the model captured
        again at that size, cut where the captured plan cuts, compiled) the first time such a
        microbatch comes. Local work, before any message of the step."""
        found = self._stage_sets.get(rows)
        if found is not None:
            return found
        plan = self.plan
        if rows != self._plan_rows:
            _LOG.info("microbatches of %d rows on rank %d (the stages were built for %d): "
                      "compiling this rank's stages for that size", rows, self.comm.rank,
                      self._plan_rows)
            plan = plan_like(self.plan, self._forward_graph(rows))
        funcs = split_forward(plan)
        if rows == self._plan_rows:  # which pp rank writes each buffer (buffers_dict)
            self._buffer_holders = {b: stage_rank(i, self.pp) for i, f in enumerate(funcs)
                                    for b in f.buffers_written}
        low = self._low_boundaries(funcs)
        stage_set = _StageSet(rows, self._build_stages(funcs, rows, low),
                              self._boundary_specs(funcs, low))
        self._stage_sets[rows] = stage_set
        if self._profiling is not None:  # a size first seen while profiling is recorded too
            for stage in stage_set.stages.values():
                self._profiling.attach(stage.machine)
        return stage_set

    def _boundary_specs(self, funcs, low):
        """(shape, dtype) of each stage's output (boundary b: stage b's output, stage b + 1's
        input), in the compute dtype where ``low`` says it travels in it."""
        specs = [type_spec(f.output_type) for f in funcs]
        return [(shape, self.compute_dtype if b in low else dtype)
                for b, (shape, dtype) in enumerate(specs)]

    def _messages(self, specs, input_specs):
        """runtime/stage_budget.py's Messages: the boundaries of ``specs`` (every stage's
        output: the last stage's is no message) and {stage: its input spec}."""
        return stage_budget.Messages(specs[:self.num_stages - 1],
                                     {s: spec for s, spec in input_specs.items() if s > 0})

    def _low_boundaries(self, funcs):
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

    def _build_stages(self, funcs, rows, low=frozenset()):
        """{stage index: _Stage} of this rank's stages (``funcs``: split_forward's functions
        at ``rows`` rows per microbatch), compiled, each with its recomputation
        (``stage_recompute``); ``low``: the boundaries whose activation travels in the
        compute dtype (``_low_boundaries``)."""
        return {s: self._build_stage(s, funcs, rows, low,
                                     self.stage_recompute[s] == "selective")
                for s in self.my_stages}

    def _build_stage(self, s, funcs, rows, low, selective):
        """Stage ``s`` compiled (``selective``: its forward keeps what "selective" keeps)."""
        key = (rows, s, selective)
        if key in self._built:
            return self._built[key]
        passes = []  # no gradient collective here: the update reduces over dp
        if self.tp > 1:
            passes.append(LowerTensorParallel(self.mesh.tp_group))
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
            target_spec=batching.batched_target_spec(self._captured_target_spec(), rows,
                                                     self.batch_size) if last else None,
            vocab_parallel=getattr(self.model, "output_split_classes", 0) > 1,
            buffer_names=funcs[s].buffer_names, buffers_written=funcs[s].buffers_written,
            selective=selective, low_precision=self.compute_dtype is not None)
        compiled = compile_step(fns.mod, passes=passes, target=self._target,
                                cache_dir=self._cache_dir)
        vm = relax.VirtualMachine(compiled.executable, self._device)
        stage = self._built[key] = _Stage(
            s, fns, {k: vm[k] for k in ("forward", "backward", "recompute", "forward_only")},
            compiled.planned_peak_bytes, vm)
        return stage

    def _choose_recomputation(self, rows):
        """{stage: recomputation} for this rank's stages: activation_checkpointing's for
        all, or under activation_memory_budget_mb the least per stage whose modelled
        activation memory fits (runtime/stage_budget.py; the stages compiled while choosing
        are kept for the first stage set). A budget no choice meets raises on every rank."""
        budget = self.run_plan.activation_memory_budget_mb
        if budget is None:  # the plan's policy: None, "full" or "selective"
            return {s: self.activation_checkpointing or False for s in self.my_stages}
        funcs = split_forward(self.plan)
        low = self._low_boundaries(funcs)

        def measure(s, level):
            stage = self._build_stage(s, funcs, rows, low, level == "selective")
            return stage_budget.saved_bytes(stage.functions, level), stage.planned_peak_bytes

        inputs = {s: type_spec(funcs[s].function.params[0].ty) for s in self.my_stages}
        timeline = stage_budget.held_timeline(
            self.actions[self.pp_rank], self.my_stages,
            self._messages(self._boundary_specs(funcs, low), inputs))
        chosen = stage_budget.choose_on_every_rank(
            self.comm, self.my_stages, timeline, measure, int(budget * 2**20),
            self.compiled_update.planned_peak_bytes)
        _LOG.info("activation_memory_budget_mb=%g on pp rank %d: recomputation %s",
                  budget, self.pp_rank, chosen)
        return chosen

    def _captured_target_spec(self):
        """The target's spec at the captured batch (from the full model's output)."""
        out = self.full_model.forward.ret_ty
        if getattr(self.full_model, "buffer_names", ()):  # (output, *new buffer values)
            out = out.fields[0]
        shape = [int(d) for d in out.shape]
        if self.loss == "cross_entropy":
            return tuple(shape[:-1]), "int64"
        return tuple(shape), str(out.dtype)

    def _parameter_holders(self, stage_plan):
        """{parameter name: the pp ranks whose stages read it}."""
        holders = {}
        for s in range(self.num_stages):
            for name in stage_plan.params[s]:
                holders.setdefault(name, set()).add(stage_rank(s, self.pp))
        return holders

    def _tied_parameters(self):
        """The trained parameters held on more than one pp rank (tied embeddings), sorted:
        their gradients are summed over the pp group before the update."""
        return sorted(n for n, ranks in self._holding_ranks.items()
                      if len(ranks) > 1 and n not in self._frozen_names)

    # ---- the step --------------------------------------------------------------------------
    def step(self, x, y):
        """One optimizer step (module docstring); returns the global mean loss everywhere.
        Any number of rows per data-parallel rank, at least num_microbatches: the rows split
        into num_microbatches microbatches as evenly as they go (np.array_split's rule), each
        size with its own compiled stages."""
        # stats()'s runtime_bytes: what the first step adds to the host's memory beyond its
        # planned temporaries (on a GPU those are the device's)
        with process_memory.first_run(
                self, lambda: 0 if device_lib.is_gpu(self._device) else self._planned_held()):
            if self._profiling is not None and self._profiling.active:
                return self._profiling.step(self._run_step, self.step_count + 1, x, y)
            return self._run_step(x, y)

    def profile(self, steps: int, path) -> str:
        """As the SPMD executor's: every stage's and the update's VM calls, and each F / B of the
        schedule as a "pipeline" event, of the next ``steps`` steps."""
        if self._profiling is not None:
            self._profiling.finish()
        machines = [st.machine for ss in self._stage_sets.values() for st in ss.stages.values()]
        self._profiling = profiler.StepProfiler(machines + [self._update_vm], self.comm.rank,
                                                steps, path)
        return str(self._profiling.path)

    @property
    def compiled_batch_sizes(self) -> list:
        """The batch sizes (rows per data-parallel rank) whose microbatches have compiled
        stages: num_microbatches x each microbatch size built (the rows of an uneven split
        count under their largest microbatch)."""
        return sorted(rows * self.microbatches for rows in self._stage_sets)

    def _run_step(self, x, y):
        """``step`` without the profiler."""
        inputs = x if isinstance(x, (tuple, list)) else (x,)
        if len(inputs) != len(self.model.input_specs):
            raise ValueError(f"step() got {len(inputs)} inputs; the model was captured with "
                             f"{len(self.model.input_specs)}")
        rows = batching.leading_rows(inputs, self.model.input_specs, self.batch_size)
        for i, (a, spec) in enumerate(zip(inputs, self.model.input_specs)):
            check_array(a, batching.batched_spec(spec, rows, self.batch_size), f"input {i}")
        check_array(y, batching.batched_target_spec(self._captured_target_spec(), rows,
                                                     self.batch_size), "target")
        if self._classes is not None:
            check_targets(y, self._classes)
        if rows < self.microbatches:
            raise ValueError(f"a batch of {rows} rows per data-parallel rank cannot fill "
                             f"num_microbatches={self.microbatches} microbatches (the schedule "
                             f"runs every one of them): pass at least {self.microbatches} rows")
        pieces = batching.microbatches(rows, self.microbatches)
        sets = {r: self._stage_set(r) for r in sorted(set(pieces))}  # local work first
        # from its first collective on, an exception on this rank ends the job
        with self.comm.collective_work(
                f"step {self.step_count + 1} (last completed: {self.step_count})"):
            loss = self._execute_schedule(inputs, y, rows, pieces, sets)
        self.comm.activity = f"work between steps (last completed: {self.step_count})"
        return loss

    def _execute_schedule(self, inputs, y, rows, pieces, sets):
        """The schedule, the update and the step's accounting on checked inputs; the loss."""
        began = time.perf_counter()
        rows_per_rank = (batches.allgather_rows(self.dp_comm, rows) if self.world > 1
                         else [rows])
        batches.check_rows_per_rank(rows_per_rank, self.dp_rank)
        # each microbatch's share of the global batch: the loss is a mean over all rows
        # (fp16: times the loss scale, a power of two, so every gradient is scaled exactly)
        scale = self._scaler.scale if self._scaler is not None else 1.0
        weights = [batching.loss_weight(r, rows_per_rank) * scale for r in pieces]
        before = collectives.comm_counters()
        loss_sum, accs = self._run_schedule(inputs, y, pieces, sets, weights)
        finite = self._all_finite(loss_sum, accs)
        if self._scaler is not None and self._overflowed(finite):  # every rank alike
            self.step_count += 1
            return float("nan")  # skipped, as the SPMD step returns it
        if not finite:
            return self._nonfinite_step(loss_sum)
        loss = self._update(accs, loss_sum, 1.0 / scale) / scale
        self._keep_rank0_buffers()
        after = collectives.comm_counters()
        self._comm_last_step = {k: after[k]["bus_bytes"] - before.get(k, {}).get("bus_bytes", 0)
                                for k in after
                                if after[k]["calls"] > before.get(k, {}).get("calls", 0)}
        if self.transport.sent_bytes:  # the pipeline's point-to-point messages
            self._comm_last_step["send"] = self.transport.sent_bytes
        self.step_count += 1
        flops = sum(self._stage_flops(sets[p]) for p in pieces)
        self._metrics.record(self.step_count, loss, self._last_lr, time.perf_counter() - began,
                             flops, sum(rows_per_rank), grad_norm=self._last_grad_norm,
                             loss_scale=self.loss_scale)
        return loss

    @staticmethod
    def _stage_flops(stage_set):
        """FLOPs of one microbatch through this rank's stages: forward and backward (a
        recomputed forward is not counted: MFU counts the model's FLOPs)."""
        if stage_set.flops is None:
            stage_set.flops = sum(metrics_lib.function_flops(st.functions.mod[name])
                                  for st in stage_set.stages.values()
                                  for name in ("forward", "backward"))
        return stage_set.flops

    def _run_schedule(self, inputs, y, pieces, sets, weights):
        """This rank's actions on microbatches of ``pieces`` rows (runtime/schedule_run.py);
        returns (weighted loss sum on the last stage, else 0; {parameter: gradient})."""
        profiling = self._profiling is not None and self._profiling.active
        run = ScheduleRun(self.actions[self.pp_rank], self.transport, sets, pieces, weights,
                          self._tensors, self._buffer_tensors, my_stages=self.my_stages,
                          recompute={s for s, level in self.stage_recompute.items()
                                     if level == "full"},
                          device=self._device,
                          dtype=self._hyper_dtype,
                          recorder=self._profiling.recorder if profiling else None)
        loss_sum, accs = run.run(inputs, y, self._target_per_row, self.param_names,
                                 self.param_specs)
        for s in self.my_stages:
            self._peak_saved[s] = max(self._peak_saved[s], run.peak_saved[s])
            self._peak_saved_bytes[s] = max(self._peak_saved_bytes[s], run.peak_saved_bytes[s])
        self._peak_held_bytes = max(self._peak_held_bytes, run.peak_held_bytes)
        self.last_timeline = run.timeline
        return loss_sum, accs

    def _keep_rank0_buffers(self):
        """DDP's broadcast_buffers over the dp group: every dp rank normalised its microbatches
        with their own statistics; dp rank 0's running statistics are kept (with
        sync_batch_norm they are equal already; the broadcast keeps them bit-identical)."""
        if self.world == 1:
            return
        for name, tensor in self._buffer_tensors.items():
            host = np.array(tensor.numpy(), order="C")
            collectives.broadcast(host.reshape(-1), root=0, group=self.dp_group)
            self._buffer_tensors[name] = tvm.runtime.tensor(host, self._device)

    def _all_finite(self, loss_sum, accs):
        """Whether the loss and every gradient are finite on every rank (one allreduce)."""
        ok = math.isfinite(loss_sum) and all(np.isfinite(t.numpy()).all() for t in accs.values())
        return self.transport.all_ranks(ok)

    def _nonfinite_step(self, loss_sum):
        loss = self.transport.broadcast_from_last_stage(loss_sum)
        loss = self.transport.dp_sum(loss) / max(1, self.world)
        step = self.step_count + 1
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            self.step_count += 1
            _LOG.warning("step %d: the loss or a gradient is not finite (loss %s); the update "
                         "was skipped on every rank (nonfinite='skip')", step, loss)
            return float("nan")
        raise raised_on_every_rank(FloatingPointError(
            f"step {step}: the loss or a gradient is not finite (loss {loss}); the update was "
            "not applied, parameters and optimizer state are unchanged. Check this step's "
            "inputs and the learning rate, or pass Trainer(nonfinite='skip')"))

    def _update(self, accs, loss_sum, unscale=1.0):
        """Tied gradients summed over their pp ranks, then the compiled update; returns the
        global mean loss (broadcast from the last stage). ``unscale``: 1 / the loss scale
        (fp16), which the update multiplies every gradient by."""
        if self._tied:
            summed = self.transport.sum_tied({n: accs[n].numpy() for n in self._tied
                                              if n in accs}, self._tied, self._specs)
            for name, host in summed.items():
                accs[name] = tvm.runtime.tensor(host, self._device)
        hypers, self._last_lr = self._next_hypers()
        if self._scaler is not None:
            hypers[GRAD_UNSCALE] = unscale
        hyper_args = [tvm.runtime.tensor(np.array(hypers[h], dtype=self._hyper_dtype),
                                         self._device) for h in self.signature.hyper_names]
        params = [self._tensors[n] for n in self.param_names]
        loss_in = tvm.runtime.tensor(np.array(loss_sum, dtype=self._hyper_dtype), self._device)
        out = self._update_fn(*params, *self._states, *hyper_args,
                              *[accs[n] for n in self.param_names], loss_in)
        n = len(params)
        for i, name in enumerate(self.param_names):
            self._tensors[name] = out[1 + i]
        self._states = [out[1 + n + i] for i in range(len(self._states))]
        loss = self._loss_of(out[0])  # averaged over dp on the last stage; the norm everyone's
        return self.transport.broadcast_from_last_stage(loss)

    # ---- state ------------------------------------------------------------------------------
    def _held(self):
        """{name: array} of every parameter this rank holds, full (tp pieces assembled)."""
        out = {}
        for name in self.param_names + self.frozen_names:
            value = self._tensors[name].numpy()
            if self.tp > 1:
                value = held.full_parameter(self.tp_plan, name, value, self.mesh.tp_group,
                                              self.tp)
            out[name] = value
        return out

    def _holders(self):
        """{parameter name: the lowest pp rank holding it} from the stage plan."""
        return {name: min(ranks) for name, ranks in self._holding_ranks.items()}

    def state_dict(self):
        """Every full parameter on every rank (gathered over pp and tp: every rank calls it)."""
        return self.transport.merge_over_pp(self._held(), self._holders(),
                                            self.full_model.param_names)

    def buffers_dict(self) -> dict:
        """Every buffer by name, as ``module.named_buffers()`` lists them: the running
        statistics of every stage (gathered over pp: every rank calls it) and the constants."""
        held = {n: t.numpy() for n, t in self._buffer_tensors.items()}
        carried = self.transport.merge_over_pp(held, self._buffer_holders,
                                               sorted(self._buffer_holders))
        order = self.full_model.buffer_order or list(carried)
        return {n: carried[n] if n in carried else self.full_model.constant_buffers[n]
                for n in order}

    def optimizer_state_dict(self):
        """{param: {state: full array}} of every parameter: every rank calls it."""
        mine = held.full_optimizer_states(self.layout, self._states, self.dp_group,
                                          self.tp_plan, self.mesh.tp_group, self.tp)
        flat = {f"{p}\0{s}": v for p, d in mine.items() for s, v in d.items()}
        holders = self._holders()
        trained = [n for n in self.full_model.param_names if n not in self._frozen_names]
        keys = [f"{p}\0{s}" for p in trained for s in self.optimizer.state_names]
        merged = self.transport.merge_over_pp(
            flat, {k: holders[k.split("\0")[0]] for k in keys}, keys)
        out = {}
        for key, value in merged.items():
            param, state = key.split("\0")
            out.setdefault(param, {})[state] = value
        return out

    def predict(self, x):
        """The model's output on the rows ``x`` (any number; one array or one per input): the
        whole forward on every rank with the full parameters (gathered over pp and tp: every
        rank calls it), in pieces of the captured batch size (runtime/predict.py).
        Evaluation, not the pipelined step."""
        specs, batch = self.full_model.input_specs, self.full_model.batch_size
        inputs, _ = predict_lib.check_rows(x, specs, batch)
        full = self.state_dict()
        params = [tvm.runtime.tensor(np.ascontiguousarray(full[n]), self._device)
                  for n in self.full_model.param_names]
        # BatchNorm: the evaluation forward with every stage's running statistics
        buffers = self.buffers_dict()
        buffers = [tvm.runtime.tensor(np.array(buffers[n], order="C"), self._device)
                   for n in getattr(self.full_model, "buffer_names", ())]

        def run_piece(pieces, rows):
            forward, _ = self._forwards.at(rows)
            return forward(*[tvm.runtime.tensor(p, self._device) for p in pieces], *params,
                           *buffers).numpy()

        return predict_lib.in_pieces(inputs, specs, batch,
                                     self.full_model.respecialize is not None, run_piece)

    def stats(self):
        """As the SPMD executor's, plus ``pipeline``: this rank's stages, the most microbatches (and
        bytes) of saved activations each stage held at once, the most saved values and
        boundary messages the rank held at once (``peak_held_bytes``) and the model of both
        (``modelled_held_bytes``; ``modelled_activation_bytes`` adds the planned
        temporaries: runtime/stage_budget.py), each stage's recomputation (False,
        "selective" or "full") and the stage plan's costs."""
        params = [self._tensors[n] for n in self.param_names + self.frozen_names]
        held, modelled = self._modelled_activation_bytes()
        return process_memory.with_total({
            "param_bytes": sum(nbytes(p) for p in params),
            "grad_bytes": sum(nbytes(self._tensors[n]) for n in self.param_names),
            "optimizer_state_bytes": sum(nbytes(s) for s in self._states),
            "held_bytes_by_dtype": bytes_by_dtype(params + list(self._states)),
            # every stage's and the update's VM keeps its own storage between steps
            "planned_peak_bytes": self._planned_held(),
            "comm_bytes_last_step": dict(self._comm_last_step),
            "pipeline": {
                "stages": list(self.my_stages), "num_stages": self.num_stages,
                "schedule": self.schedule, "microbatches": self.microbatches,
                "peak_saved_microbatches": dict(self._peak_saved),
                "peak_saved_bytes": dict(self._peak_saved_bytes),
                "peak_held_bytes": self._peak_held_bytes,
                "recompute": dict(self.stage_recompute),
                "modelled_activation_bytes": modelled,
                "modelled_held_bytes": held,
                "stage_costs": list(self.plan.costs)},
            **device_lib.memory_stats(self._device),
            **process_memory.overheads(),  # compiled code, libraries loaded
        })

    def _planned_held(self):
        """The planned temporaries of every machine this rank runs (each stage's and the
        update's VM keeps its own storage between steps)."""
        return (sum(st.planned_peak_bytes for ss in self._stage_sets.values()
                    for st in ss.stages.values()) + self.compiled_update.planned_peak_bytes)

    def _modelled_activation_bytes(self):
        """runtime/stage_budget.py's model of this rank's activation memory at the captured
        microbatch size: (saved values and boundary messages at their peak, the whole model:
        what activation_memory_budget_mb is held to)."""
        stage_set = self._stage_sets[self._plan_rows]
        stages = stage_set.stages
        messages = self._messages(stage_set.boundary_specs,
                                  {s: st.functions.input_specs[0] for s, st in stages.items()})
        timeline = stage_budget.held_timeline(self.actions[self.pp_rank], self.my_stages,
                                              messages)
        saved = {s: stage_budget.saved_bytes(st.functions, self.stage_recompute[s])
                 for s, st in stages.items()}
        return (stage_budget.modelled_peak(timeline, saved, {}),
                stage_budget.modelled_peak(timeline, saved,
                                           {s: st.planned_peak_bytes for s, st in stages.items()},
                                           self.compiled_update.planned_peak_bytes))

    def save_checkpoint(self, path, extra=None, keep=2):
        """The full tensors written as any layout writes them (full_train_state), so a
        checkpoint saved at pp x dp resumes at any pp x dp x tp: every rank calls it."""
        full = self.state_dict()
        states = {(p, s): v for p, d in self.optimizer_state_dict().items()
                  for s, v in d.items()}
        view = held.full_train_state(self, full)
        return ckpt.save(view, path, [full[n] for n in view.signature.param_names], states,
                         extra, keep, buffers=self.buffers_dict())

    def load_checkpoint(self, path):
        """Load a checkpoint of any layout; this rank keeps the parameters it holds."""
        view = held.full_train_state(self, {})
        params, states, buffers, frozen, meta = ckpt.load(view, path)
        for name in self._buffer_tensors:
            self._buffer_tensors[name] = tvm.runtime.tensor(
                np.array(buffers[name], order="C"), self._device)
        full = dict(zip(view.signature.param_names, params))
        full.update(frozen)
        for name in self.param_names + self.frozen_names:
            value = np.asarray(full[name])
            if self.tp > 1:
                value = self.tp_plan.local_shard(name, value, self.mesh.tp_rank)
            self._tensors[name] = tvm.runtime.tensor(np.ascontiguousarray(value), self._device)
        mine = {k: v for k, v in states.items() if k[0] in self.param_names}
        if self.tp > 1:
            mine = {k: self.tp_plan.local_shard(k[0], np.asarray(v), self.mesh.tp_rank)
                    for k, v in mine.items()}
        if self.layout.states_sharded:
            mine = {k: self.layout.shard(v) for k, v in mine.items()}
        self._states = [tvm.runtime.tensor(a, self._device) for a in self.layout.pack_states(mine)]
        self.step_count, self.seed = int(meta["step"]), int(meta["seed"])
        self.load_loop_state(meta.get("loop", {}))
        return meta.get("extra")


def check_pipeline_config(config, model):
    """What pipelining cannot run, refused from the config and model alone (no collective)."""
    pp, zero = int(config.pipeline_parallel_size), int(config.zero_opt_level)
    if zero > 1:
        raise ValueError(
            f"zero_opt_level={zero} with pipeline_parallel_size={pp} is not supported: "
            "ZeRO-2/3 reduce-scatter gradients (and gather parameters) per microbatch, which "
            "pipelining would repeat M times per step (DeepSpeed refuses the combination too). "
            "Use zero_opt_level=1 (optimizer state sharded) or 0")
    if config.pipeline_schedule not in schedules.SCHEDULES:
        raise NotImplementedError(f"pipeline_schedule={config.pipeline_schedule!r} is not "
                                  f"built; use one of {schedules.SCHEDULES}")
    M = int(config.num_microbatches)
    if config.pipeline_schedule == "interleaved_1f1b" and M % pp:
        raise ValueError(f"interleaved_1f1b needs num_microbatches to be a multiple of "
                         f"pipeline_parallel_size={pp}, got {M}")
    if model.dropout_specs:
        raise NotImplementedError(
            f"{model.source}: pipelining a model with dropout is not supported yet (the masks "
            "would have to follow the stages); set the dropout rates to 0")
    rows = model.batch_size
    if rows is None or rows % M:
        raise ValueError(
            f"{model.source} was captured with {rows} rows per data-parallel rank, which "
            f"num_microbatches={M} does not divide into equal microbatches; capture it with "
            f"a multiple of {M} rows")
