"""The pipeline-parallel Trainer: stages on the pp axis of the mesh, a schedule executed with
tagged asynchronous point-to-point messages (DESIGN.md section 3c).

``raf_dist.Trainer`` runs a ``PipelineExecutor`` when ``pipeline_parallel_size`` > 1. Every
rank captures the same model, cuts it into S stages (passes/stage_split.py: markers, named split
points or the cost partitioner), builds and compiles the functions of the stages it holds
(training/pipeline_step.py: forward, backward, recompute, forward_only) at the microbatch's rows
and one update function over its parameters, with the data-parallel / ZeRO-1 pass over the dp
group (runtime/pipeline_build.py builds all of it). A step then runs this rank's action
list (training/pipeline_schedule.py):

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
import logging
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from .. import process_memory
from ..compiler.step_passes import forward_passes
from ..distributed import collectives
from ..training import batch_size as batching
from ..training import pipeline_schedule as schedules
from ..training.loss import num_classes
from ..training.step import GRAD_UNSCALE, TrainStepSignature, hyper_arguments
from . import agreement, batches
from . import metrics as metrics_lib
from . import predict as predict_lib
from . import state as held
from .executor import ExecutorFrame
from .pipeline_build import PipelineBuilder, StageSet
from .plan import RunPlan
from .schedule_run import ScheduleRun
from .tensors import bytes_by_dtype, nbytes
from .transport import PipelineTransport

_LOG = logging.getLogger("raf_dist")


class PipelineExecutor(ExecutorFrame):
    """The executor for ``pipeline_parallel_size`` > 1 (module docstring): the whole Trainer
    surface over this rank's stages (``profile``, ``buffers_dict``, ``predict``,
    checkpoints, any batch size of at least ``num_microbatches`` rows)."""

    def __init__(self, model: Any, loss: str, optimizer: Any, device: str, plan: RunPlan,
                 mesh: Any, comm: Any, cache_dir: Any = None, seed: int = 0,
                 nonfinite: str = "raise", tensor_parallel_plan: Any = None,
                 precision: str = "fp32", grad_reduce_dtype: str = "float32",
                 lr_schedule: Any = None, log_every: int = 0,
                 max_grad_norm: Optional[float] = None) -> None:
        """See raf_dist.Trainer: the arguments are checked, the pipeline config too
        (``layout.refusals.REFUSALS``) and the ranks agreed (the front did all three)."""
        # bf16 / fp16: each stage's forward cast by AutoCast, its activation in and out in
        # the low dtype; fp16 scales the last stage's seeds (every gradient with them)
        super().__init__(model, loss, optimizer, device, plan, mesh, comm, cache_dir=cache_dir,
                         seed=seed, nonfinite=nonfinite, precision=precision,
                         grad_reduce_dtype=grad_reduce_dtype, lr_schedule=lr_schedule,
                         max_grad_norm=max_grad_norm)
        self.pp_rank, self.pp_comm = mesh.pp_rank, mesh.pp_comm
        builder = self.builder = PipelineBuilder(
            model, loss, optimizer, plan, mesh, comm, self._device, self._target,
            compute_dtype=self.compute_dtype, loss_scale=self._scaler is not None,
            max_grad_norm=max_grad_norm, grad_reduce_dtype=grad_reduce_dtype,
            cache_dir=cache_dir, dp_rank=self.dp_rank, tensor_parallel_plan=tensor_parallel_plan)
        model = self.model = builder.model
        self.tp_plan, self.num_stages, self.batch_size = (builder.tp_plan, builder.num_stages,
                                                          builder.batch_size)
        self._classes = num_classes(self.full_model.forward, loss)
        self._target_per_row: Any = batching.target_rows_per_row(
            builder.captured_target_spec(), self.batch_size)
        self.plan, self.my_stages, self.actions = builder.plan, builder.my_stages, \
            builder.actions
        self.param_names, self.frozen_names = builder.param_names, builder.frozen_names
        self.param_specs, self._specs = builder.param_specs, builder.specs
        self.grad_buckets, self.layout = builder.grad_buckets, builder.layout
        self.compiled_update, self._update_vm = builder.compiled_update, builder.update_vm
        self._update_fn, self.stage_recompute = builder.update_fn, builder.stage_recompute
        self._stage_sets: Dict[int, StageSet] = {}  # microbatch rows -> StageSet
        self._stage_set(builder.plan_rows)
        specs = self._specs
        self.signature = TrainStepSignature(
            input_specs=list(model.input_specs), target_spec=builder.captured_target_spec(),
            param_names=self.param_names, param_specs=self.param_specs,
            state_names=list(optimizer.state_names), row_states=list(optimizer.row_states),
            hyper_names=hyper_arguments(optimizer, self.param_names)
            + ([GRAD_UNSCALE] if self._scaler is not None else []),
            frozen_names=self.frozen_names, frozen_specs=[specs[n] for n in self.frozen_names],
            buffer_names=list(getattr(model, "buffer_names", ())),
            buffer_specs=model.buffer_specs() if getattr(model, "buffer_names", ()) else [])
        process_memory.after_compile()  # the compile's transient gone before the states come
        self._init_parameters(model)
        self._tied = builder.tied_parameters()
        self._metrics = metrics_lib.StepMetrics(metrics_lib.tokens_per_row(model.input_specs),
                                                log_every)
        # the last step's F / B actions on this rank: (kind, stage, microbatch, start, end)
        # in time.perf_counter seconds (bench/pipeline.py measures the bubble from them)
        self.last_timeline: List[Any] = []
        self._hyper_dtype = self.param_specs[0][1]
        self._peak_saved = {s: 0 for s in self.my_stages}
        self._peak_saved_bytes = {s: 0 for s in self.my_stages}
        self._peak_held_bytes = 0  # saved values + boundary messages (ScheduleRun)
        microbatches = self.parallel.microbatches
        self.transport = PipelineTransport(mesh, self.num_stages, microbatches)
        schedules.check_actions(self.actions, self.num_stages, microbatches)
        agreement.check_fingerprints(comm, *self.fingerprint())
        # the buffers this rank's stages write (BatchNorm running statistics) at rank 0's
        # initial values (every rank takes part in every buffer's broadcast); buffers_dict
        # gathers every stage's
        written = {b for ss in self._stage_sets.values() for st in ss.stages.values()
                   for b in st.functions.buffers_written}
        initial = self._initial_buffers(model, getattr(model, "buffer_names", ()), True)
        self._buffer_tensors = {n: tvm.runtime.tensor(v, self._device)
                                for n, v in initial.items() if n in written}
        # the parameter tensors hold the values now: the models keep their shapes only (one
        # copy of the weights in the process; Model.without_values)
        lean = self.model.without_values()
        self.full_model = (lean if self.full_model is self.model
                           else self.full_model.without_values())
        self.model = builder.model = lean  # (the builder lets go of the values too)
        builder.full_model = self.full_model
        self._forwards = predict_lib.Forwards(  # predict's compiled forwards by rows
            self.full_model.at_batch, forward_passes(), self._target, self._device, cache_dir,
            self.compute_dtype)  # in the training precision, as the SPMD executor's

    def _init_parameters(self, model: Any) -> None:
        """This rank's stages' parameters at world rank 0's initial values (whatever each
        rank's seed; under tensor parallelism split_model broadcast them already) and fresh
        optimizer states."""
        init = {}
        for name in model.param_names:
            value = np.ascontiguousarray(model.init_params[name]).copy()
            if self.parallel.tp == 1:  # every rank takes part, whichever stage holds it
                value = collectives.broadcast(value, root=0)
            if name in self.param_names or name in self.frozen_names:
                init[name] = value
        self._tensors = {n: tvm.runtime.tensor(v, self._device) for n, v in init.items()}
        fresh = self.layout.zero_states(self.optimizer.initial_states_by_param(
            self.param_names))
        self._states = [tvm.runtime.tensor(a, self._device) for a in fresh]

    def fingerprint(self) -> Tuple[str, Dict[str, Any]]:
        """(digest, description) as the SPMD executor's, with the stage plan instead of the
        parameters (each pp rank holds other ones; the agreement at construction compared
        the whole model already)."""
        return agreement.fingerprint(dict(agreement.step_description(self), pipeline={
            "stages": self.num_stages, "cuts": list(self.plan.cuts)}))

    @property
    def update_guarded(self) -> bool:
        """Always: the update runs only once every rank's gradients are known finite."""
        return True

    def dropout_masks(self, step: int, rows: Optional[int] = None,
                      microbatch: Optional[int] = None) -> List[np.ndarray]:
        """No masks: pipelining refuses models with dropout (layout.refusals.REFUSALS)."""
        return []

    def _stage_set(self, rows: int) -> StageSet:
        """This rank's stages for microbatches of ``rows`` rows: built the first time such a
        microbatch comes (PipelineBuilder.stage_set). Local work, before any message."""
        found = self._stage_sets.get(rows)
        if found is not None:
            return found
        stage_set = self._stage_sets[rows] = self.builder.stage_set(rows)
        if stage_set.buffer_holders is not None:
            self._buffer_holders = stage_set.buffer_holders
        if self._profiling is not None:  # a size first seen while profiling is recorded too
            for stage in stage_set.stages.values():
                self._profiling.attach(stage.machine)
        return stage_set

    @property
    def compiled_batch_sizes(self) -> List[int]:
        """The batch sizes (rows per data-parallel rank) whose microbatches have compiled
        stages: num_microbatches x each microbatch size built (the rows of an uneven split
        count under their largest microbatch)."""
        return sorted(rows * self.parallel.microbatches for rows in self._stage_sets)

    # ---- the step --------------------------------------------------------------------------
    def _prepare(self, inputs: Sequence[Any], rows: int) -> Any:
        """(pieces, {rows: StageSet}): any number of rows per data-parallel rank, at least
        num_microbatches: the rows split into num_microbatches microbatches as evenly as they
        go (np.array_split's rule), each size with its own compiled stages."""
        microbatches = self.parallel.microbatches
        if rows < microbatches:
            raise ValueError(f"a batch of {rows} rows per data-parallel rank cannot fill "
                             f"num_microbatches={microbatches} microbatches (the schedule "
                             f"runs every one of them): pass at least {microbatches} rows")
        pieces = batching.microbatches(rows, microbatches)
        return pieces, {r: self._stage_set(r) for r in sorted(set(pieces))}

    def _execute(self, inputs: Sequence[Any], y: Any, rows: int, prepared: Any) -> float:
        """The schedule, the update and the step's accounting on checked inputs; the loss."""
        pieces, sets = prepared
        began = time.perf_counter()
        rows_per_rank = (batches.allgather_rows(self.dp_comm, rows)
                         if self.parallel.grad_world > 1 else [rows])
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
        if not finite:  # every rank alike: the loss broadcast, the frame's policy
            loss = self.transport.broadcast_from_last_stage(loss_sum)
            self._nonfinite_step(self.transport.dp_sum(loss) / max(1, self.parallel.grad_world))
            self.step_count += 1
            return float("nan")
        loss = self._update(accs, loss_sum, 1.0 / scale) / scale
        names = list(self._buffer_tensors)
        self._buffer_tensors = dict(zip(names, self._rank0_buffers(
            [self._buffer_tensors[n] for n in names])))
        self._comm_last_step = self._sent(collectives.comm_counters(), before)
        if self.transport.sent_bytes:  # the pipeline's point-to-point messages
            self._comm_last_step["send"] = self.transport.sent_bytes
        flops = sum(self.builder.stage_flops(sets[p]) for p in pieces)
        return self._finish_step(loss, began, flops, sum(rows_per_rank))

    def _machines(self) -> List[Any]:
        """Every stage's and the update's VM (profile records their calls, and each F / B of
        the schedule as a "pipeline" event)."""
        return [st.machine for ss in self._stage_sets.values()
                for st in ss.stages.values()] + [self._update_vm]

    def _run_schedule(self, inputs: Sequence[Any], y: Any, pieces: List[int],
                      sets: Dict[int, StageSet], weights: List[float]) -> Tuple[float, Any]:
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

    def _all_finite(self, loss_sum: float, accs: Dict[str, Any]) -> bool:
        """Whether the loss and every gradient are finite on every rank (one allreduce)."""
        ok = math.isfinite(loss_sum) and all(np.isfinite(t.numpy()).all() for t in accs.values())
        return self.transport.all_ranks(ok)

    def _update(self, accs: Dict[str, Any], loss_sum: float, unscale: float = 1.0) -> float:
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

    def _held(self) -> Dict[str, np.ndarray]:
        """{name: array} of every parameter this rank holds, full (tp pieces assembled)."""
        out = {}
        for name in self.param_names + self.frozen_names:
            value = self._tensors[name].numpy()
            if self.parallel.tp > 1:
                value = held.full_parameter(self.tp_plan, name, value, self.mesh.tp_group,
                                            self.parallel.tp)
            out[name] = value
        return out

    def state_dict(self) -> Dict[str, np.ndarray]:
        """Every full parameter on every rank (gathered over pp and tp: every rank calls it)."""
        return self.transport.merge_over_pp(self._held(), self.builder.holders(),
                                            self.full_model.param_names)

    def buffers_dict(self) -> Dict[str, np.ndarray]:
        """Every buffer by name, as ``module.named_buffers()`` lists them: the running
        statistics of every stage (gathered over pp: every rank calls it) and the constants."""
        held = {n: t.numpy() for n, t in self._buffer_tensors.items()}
        carried = self.transport.merge_over_pp(held, self._buffer_holders,
                                               sorted(self._buffer_holders))
        return self._named_buffers(carried, self.full_model)

    def optimizer_state_dict(self) -> Dict[str, Dict[str, np.ndarray]]:
        """{param: {state: full array}} of every parameter: every rank calls it."""
        mine = held.full_optimizer_states(self.layout, self._states, self.dp_group,
                                          self.tp_plan, self.mesh.tp_group,
                                          self.parallel.tp)
        flat = {f"{p}\0{s}": v for p, d in mine.items() for s, v in d.items()}
        holders = self.builder.holders()
        trained = [n for n in self.full_model.param_names if n not in self.builder._frozen_names]
        keys = [f"{p}\0{s}" for p in trained for s in self.optimizer.state_names]
        merged = self.transport.merge_over_pp(
            flat, {k: holders[k.split("\0")[0]] for k in keys}, keys)
        out: Dict[str, Dict[str, np.ndarray]] = {}
        for key, value in merged.items():
            param, state = key.split("\0")
            out.setdefault(param, {})[state] = value
        return out

    def predict(self, x: Any) -> np.ndarray:
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
        named = self.buffers_dict()
        buffers = [tvm.runtime.tensor(np.array(named[n], order="C"), self._device)
                   for n in getattr(self.full_model, "buffer_names", ())]

        def run_piece(pieces: Sequence[Any], rows: int) -> np.ndarray:
            forward, _ = self._forwards.at(rows)
            return forward(*[tvm.runtime.tensor(p, self._device) for p in pieces], *params,
                           *buffers).numpy()

        return predict_lib.in_pieces(inputs, specs, batch,
                                     self.full_model.respecialize is not None, run_piece)

    def _stats_entries(self) -> Dict[str, Any]:
        """As the SPMD executor's, plus ``pipeline``: this rank's stages, the most microbatches (and
        bytes) of saved activations each stage held at once, the most saved values and
        boundary messages the rank held at once (``peak_held_bytes``) and the model of both
        (``modelled_held_bytes``; ``modelled_activation_bytes`` adds the planned
        temporaries: runtime/stage_budget.py), each stage's recomputation (False,
        "selective" or "full") and the stage plan's costs."""
        params = [self._tensors[n] for n in self.param_names + self.frozen_names]
        held, modelled = self.builder.modelled_activation_bytes(
            self._stage_sets[self.builder.plan_rows])
        return {
            "param_bytes": sum(nbytes(p) for p in params),
            "grad_bytes": sum(nbytes(self._tensors[n]) for n in self.param_names),
            "optimizer_state_bytes": sum(nbytes(s) for s in self._states),
            "held_bytes_by_dtype": bytes_by_dtype(params + list(self._states)),
            # every stage's and the update's VM keeps its own storage between steps
            "planned_peak_bytes": self._planned_peak(),
            "comm_bytes_last_step": dict(self._comm_last_step),
            "pipeline": {
                "stages": list(self.my_stages), "num_stages": self.num_stages,
                "schedule": self.parallel.schedule,
                "microbatches": self.parallel.microbatches,
                "peak_saved_microbatches": dict(self._peak_saved),
                "peak_saved_bytes": dict(self._peak_saved_bytes),
                "peak_held_bytes": self._peak_held_bytes,
                "recompute": dict(self.stage_recompute),
                "modelled_activation_bytes": modelled,
                "modelled_held_bytes": held,
                "stage_costs": list(self.plan.costs)}}

    def _planned_peak(self) -> int:
        """The planned temporaries of every machine this rank runs (each stage's and the
        update's VM keeps its own storage between steps)."""
        return (sum(st.planned_peak_bytes for ss in self._stage_sets.values()
                    for st in ss.stages.values()) + self.compiled_update.planned_peak_bytes)

    def save_checkpoint(self, path: Any, extra: Any = None, keep: int = 2) -> Any:
        """The full tensors written as any layout writes them (full_train_state), so a
        checkpoint saved at pp x dp resumes at any pp x dp x tp: every rank calls it."""
        return self._save_full(path, extra, keep)

    def load_checkpoint(self, path: Any) -> Any:
        """Load a checkpoint of any layout; this rank keeps the parameters it holds."""
        full, states, buffers, frozen, meta = self._load_full(path)
        for name in self._buffer_tensors:
            self._buffer_tensors[name] = tvm.runtime.tensor(
                np.array(buffers[name], order="C"), self._device)
        full.update(frozen)
        for name in self.param_names + self.frozen_names:
            value = np.asarray(full[name])
            if self.parallel.tp > 1:
                value = self.tp_plan.local_shard(name, value, self.mesh.tp_rank)
            self._tensors[name] = tvm.runtime.tensor(np.ascontiguousarray(value), self._device)
        mine = {k: v for k, v in states.items() if k[0] in self.param_names}
        if self.parallel.tp > 1:
            mine = {k: self.tp_plan.local_shard(k[0], np.asarray(v), self.mesh.tp_rank)
                    for k, v in mine.items()}
        if self.layout.states_sharded:
            mine = {k: self.layout.shard(v) for k, v in mine.items()}
        self._states = [tvm.runtime.tensor(a, self._device) for a in self.layout.pack_states(mine)]
        return self._loaded(meta)
