"""The SPMD executor: one compiled training step per batch size, run by every rank of the job
together (data parallel, ZeRO, tensor parallel) or by one rank alone (DESIGN.md section 2).

It builds the training step (``training.build_train_step``), compiles it with the passes the
run's plan asks for (``compiler.step_passes``), and runs it on the VM: microbatch accumulation,
batch-size variants, the non-finite policy. Parameters and optimizer state stay in runtime
tensors between steps, held as the ``StateLayout`` says (``raf_dist.layout``).
``raf_dist.Trainer`` builds one (``pipeline_parallel_size`` 1) and forwards its surface to it.
"""
import logging
import math
import time
import zlib

import numpy as np
import tvm
from tvm import relax

from .. import checkpoint as ckpt
from .. import process_memory
from .. import device as device_lib
from .. import profiler
from ..compiler import compile_step
from ..compiler.build import plan_memory
from ..compiler.step_passes import forward_passes, nonfinite_guard, step_passes
from ..distributed import collectives
from ..distributed.communicator import raised_on_every_rank
from ..layout import state_layout
from ..passes import gradient_buckets, remat
from ..passes.batch_norm import decompose_forward, has_training_batch_norm
from ..passes.clipping import Clip
from ..training import build_train_step
from ..training import batch_size as batching
from ..training import embedding_parallel as ep_lib
from ..training.loss import check_targets, num_classes
from ..training.step import GRAD_UNSCALE
from ..training.tensor_parallel import trained_names
from . import agreement, batches, mixed_precision
from . import embedding_update  # noqa: F401  (registers the sparse table update it runs)
from . import metrics as metrics_lib
from . import predict as predict_lib
from . import state as held
from .loop import LoopScalars
from .loss_scale import LossScaler
from .plan import RunPlan
from .tensors import bytes_by_dtype, check_array, nbytes, numpy_dtype, to_device

_LOG = logging.getLogger("raf_dist")


def _describe(policy):
    """A budget's recomputation point in words (passes/remat.py)."""
    if isinstance(policy, remat.Cheapest):
        return "none" if policy.count == 0 else f"{policy.count} of selective's values"
    return f"{policy.count} blocks as full, the rest selective"


class SPMDExecutor(LoopScalars):
    """Train ``model`` (a :class:`raf_dist.model.Model`) with ``loss`` and ``optimizer``.

    ``step(x, y)`` takes this rank's slice of the global batch (numpy arrays) and returns the
    mean loss as a float; ``state_dict()`` returns the full parameters as numpy arrays.
    """

    def __init__(self, model, loss, optimizer, device, plan: RunPlan, mesh, comm,
                 cache_dir=None, seed=0, nonfinite="raise", tensor_parallel_plan=None,
                 precision="fp32", grad_reduce_dtype="float32", lr_schedule=None,
                 log_every=0, max_grad_norm=None, embedding_plan=None):
        """See raf_dist.Trainer: the arguments are checked and the ranks agreed (the front
        did both); ``plan`` is the config read once, ``mesh`` the mesh it runs on."""
        self.run_plan, self.config, self.comm, self.mesh = plan, plan.config, comm, mesh
        self.local, self.tp, self.zero_level = plan.local, plan.tp, plan.zero_level
        self.data_parallel, self.world, self.spmd = plan.data_parallel, plan.world, plan.spmd
        self.dp_group, self.dp_comm = mesh.dp_group, mesh.dp_comm
        self.dp_rank = mesh.dp_rank if self.world > 1 else 0
        self.model, self.full_model = model, model
        self.loss, self.optimizer, self.device = loss, optimizer, device
        self.nonfinite, self.seed, self._cache_dir = nonfinite, int(seed), cache_dir
        self.precision, self.grad_reduce_dtype = precision, grad_reduce_dtype
        self.lr_schedule, self._last_lr = lr_schedule, None
        self.max_grad_norm, self._last_grad_norm = max_grad_norm, None
        # float16's range needs the loss scaled (runtime/loss_scale.py); bfloat16's does not
        self._scaler = LossScaler() if precision == "fp16" else None
        self.compute_dtype = mixed_precision.compute_dtype(precision, device)
        # gradients travel in grad_reduce_dtype only where they travel (dp > 1)
        self._reduce_dtype = (grad_reduce_dtype if grad_reduce_dtype != "float32"
                              and plan.data_parallel and plan.world > 1 else None)
        self.microbatches, self.bucket_bytes = plan.microbatches, plan.bucket_bytes
        # synchronized batch norm: statistics of the global batch (passes/batch_norm.py)
        self.sync_batch_norm_world = plan.sync_batch_norm_world
        self.skipped_steps = 0  # steps whose update nonfinite="skip" left out
        self.step_count = 0
        self._comm_last_step, self._comm_by_axis = {}, {}
        self._profiling = None  # a profiler.StepProfiler while profile records
        # collective only when every rank builds this Trainer (data parallel, several ranks)
        self._device = device_lib.select(device, comm, collective=self.spmd)
        self._target = device_lib.target_for(self._device)

        model = self.model = self._split_for_tp(model, tensor_parallel_plan)
        model = self.model = self._split_for_embeddings(model, embedding_plan)
        self._clip = self._make_clip(max_grad_norm)
        self._build_step(model)
        # from the fingerprint check on the ranks meet in collectives (and compile barriers):
        # an exception on one rank ends the job (Communicator.collective_work)
        with comm.collective_work("building a Trainer (compiling its step)", self.spmd):
            if self.spmd:
                agreement.check_fingerprints(comm, *self.fingerprint())
            self._compile_captured(model)
            init = self._initial_params(model)
        process_memory.after_compile()  # the compile's transient gone before the states come
        self._init_state(model, init)
        del init
        self._keep_shapes_only()
        # FLOPs scale with the rows (every matmul / convolution has the batch in it)
        self._flops_per_row = metrics_lib.function_flops(self.ir["train_step"]) / self.batch_size
        self._metrics = metrics_lib.StepMetrics(
            metrics_lib.tokens_per_row(self.signature.input_specs), log_every)
        self._forwards = predict_lib.Forwards(  # predict's compiled forwards by rows
            self._model_at, forward_passes(self.mesh.tp_group if self.tp > 1 else None,
                                           self._embedding_group()),
            self._target, self._device, cache_dir, self.compute_dtype)

    # ---- construction, in steps --------------------------------------------------------------
    def _keep_shapes_only(self):
        """Once the runtime tensors hold the parameters, the models this executor keeps
        (for their IR, shapes and recapture) let go of their initial values: the process
        holds one copy of the weights (Model.without_values)."""
        lean = {}

        def shapes_only(model):
            if id(model) not in lean:
                lean[id(model)] = model.without_values()
            return lean[id(model)]

        self.model, self.full_model = shapes_only(self.model), shapes_only(self.full_model)
        self._models = {rows: shapes_only(m) for rows, m in self._models.items()}
        for variant in self._variants.values():
            variant.model = shapes_only(variant.model)

    def _split_for_tp(self, model, tensor_parallel_plan):
        """This rank's tp piece of ``model`` (training/tensor_parallel.py), or ``model``."""
        self.tp_plan = None
        if self.tp > 1:
            # the tables sharded over the dp ranks stay whole on every tp rank of a dp group
            tables = (ep_lib.table_names(model) if self.run_plan.embeddings_sharded else ())
            self.tp_plan, model = held.split_model(model, self.tp, tensor_parallel_plan,
                                                   self.loss, self.comm, self.mesh.tp_rank,
                                                   keep_whole=tables)
        elif tensor_parallel_plan is not None:
            raise ValueError("tensor_parallel_plan needs tensor_parallel_size > 1; set "
                             "dist.get_config().tensor_parallel_size first")
        return model

    def _split_for_embeddings(self, model, embedding_plan):
        """This rank's model with the embedding tables sharded over the dp group
        (training/embedding_parallel.py), or ``model``; the ids check of each step."""
        self.ep_plan, self._check_ids = None, None
        mode = self.run_plan.embedding_parallel
        if embedding_plan is not None and mode != "table":
            raise ValueError("embedding_plan places whole tables on ranks: it needs "
                             "dist.get_config().embedding_parallel = 'table' (got "
                             f"{mode!r})")
        if not self.run_plan.embeddings_sharded:
            return model
        self.ep_plan = ep_lib.make_plan(model, mode, self.world, embedding_plan)
        full = {}
        for name in model.param_names:  # dp rank 0's tables, as DDP starts from rank 0's
            value = np.ascontiguousarray(model.init_params[name])
            full[name] = (collectives.broadcast(value.copy(), root=0, group=self.dp_group)
                          if name in self.ep_plan.shapes else value)
        self._check_ids = ep_lib.IdsCheck(self.ep_plan, model.without_values().at_batch,
                                          len(model.input_specs))  # shapes only: one copy
        return ep_lib.shard_model(model, self.ep_plan, self.dp_rank, full)

    def _embedding_group(self):
        """The dp group the tables are sharded over, or None."""
        return self.dp_group if self.ep_plan is not None else None

    def _build_step(self, model):
        """The training step's IR and signature at the captured batch size, checked."""
        if self.microbatches > 1 and self.data_parallel and self.zero_level == 3:
            raise ValueError(
                f"num_microbatches={self.microbatches} with zero_opt_level=3 is not supported: "
                "the microbatches before the last would need the parameters gathered again "
                "each time. Use zero_opt_level <= 2 or num_microbatches=1")
        # ranks may hold different numbers of rows, and microbatches (gradient accumulation,
        # DESIGN.md 3c at P = 1) too: each weights its loss by rows (training/batch_size.py)
        self._weighted_loss = (self.data_parallel and self.world > 1) or self.microbatches > 1
        step_model = model
        if self.sync_batch_norm_world > 1 and has_training_batch_norm(model.mod):
            step_model = decompose_forward(model, self.sync_batch_norm_world)
        if self.run_plan.activation_memory_budget_mb is not None:
            self.recompute, (self.ir, self.signature) = self._recompute_within_budget(
                step_model)
        else:
            self.recompute = self.run_plan.activation_checkpointing
            self.ir, self.signature = build_train_step(step_model, self.loss, self.optimizer,
                                                       **self._step_options(self.recompute))
        batching.check_target_splits(self.signature.target_spec, model.batch_size,
                                     self.microbatches, model.source)
        # for the target check: the model's classes (all of them under tensor parallelism)
        self._classes = num_classes(self.full_model.forward, self.loss)
        self._hyper_dtype = (self.signature.param_specs[0][1] if self.signature.param_specs
                             else "float32")

    def _recompute_within_budget(self, step_model):
        """(policy, (step IR, signature)): the least recomputation whose planned step
        temporaries fit activation_memory_budget_mb, planned with this rank's passes (with
        num_microbatches > 1: the microbatches' steps, ``_microbatch_peak``), and its
        step; a ValueError naming the smallest reachable peak when none does (before any
        collective: every rank of an SPMD job plans the same step).

        The points (passes/remat.py ``ladder``): from none to "selective", its values one at
        a time, cheapest first (``Cheapest``); from "selective" to "full", its blocks one at a
        time (``FullBlocks``). Within a range fewer recomputed values plan to more memory, so
        the first point that fits is found by bisection (~log2 of the points' count of plans);
        only points actually planned and fitting are chosen, so a step that is not monotone in
        them costs optimality, never the budget.

        With sharded embedding tables each rank's step differs (the tables it holds, the bags
        its holders pool), so a point's peak is the largest over the dp group (one allgather
        per point planned) and the ladder walked is the ranks' common part (the fewest
        values, the fewest blocks: ``Cheapest(i)`` is each rank's i cheapest values): the
        ranks walk the same points and choose one policy, as their fingerprints require."""
        budget = self.run_plan.activation_memory_budget_mb
        peaks, builds = {}, {}
        agreeing = self.ep_plan is not None and self.world > 1

        def build(policy):
            if policy not in builds:
                builds[policy] = build_train_step(step_model, self.loss, self.optimizer,
                                                  **self._step_options(policy))
            return builds[policy]

        def plan(policy):  # with microbatches, the microbatches' steps are what runs
            if policy not in peaks:
                peaks[policy] = (self._microbatch_peak(policy) if self.microbatches > 1 else
                                 plan_memory(build(policy)[0], self._passes(), self._target))
                if agreeing:
                    peaks[policy] = max(self.dp_comm.allgather(peaks[policy]))
            return peaks[policy] <= budget * 2**20

        def chosen(policy):
            _LOG.info("activation_memory_budget_mb=%g: recomputation %s (planned temporaries "
                      "%.1f MB; %d points planned)", budget, _describe(policy),
                      peaks[policy] / 2**20, len(peaks))
            return (None if policy == remat.Cheapest(0) else policy), build(policy)

        if plan(remat.Cheapest(0)):  # no recomputation
            return chosen(remat.Cheapest(0))
        values, blocks = build(remat.Cheapest(0))[1].recompute_ladder
        if agreeing:  # the same points on every rank: the ladders' common part
            ladders = self.dp_comm.allgather((values, blocks))
            values, blocks = min(v for v, _ in ladders), min(b for _, b in ladders)
        # each range bisected only once its top end ("selective", then "full") fits: the two
        # policies' peaks are not ordered (a small model's kept head can outweigh the saving)
        for points in ([remat.Cheapest(i) for i in range(values + 1)],
                       [remat.Cheapest(values)] + [remat.FullBlocks(k)
                                                  for k in range(1, blocks + 1)]):
            if not plan(points[-1]):
                continue
            low, high = 0, len(points) - 1  # points[low] does not fit, points[high] does
            while high - low > 1:
                middle = (low + high) // 2
                if plan(points[middle]):
                    high = middle
                else:
                    low = middle
            return chosen(points[high])
        best = min(peaks, key=lambda p: peaks[p])
        raise ValueError(
            f"activation_memory_budget_mb={budget:g}: the step's planned temporaries cannot "
            f"fit; the smallest reachable is {peaks[best] / 2**20:.3g} MB (recomputation "
            f"{_describe(best)}; none {peaks[remat.Cheapest(0)] / 2**20:.3g} MB). Raise the "
            "budget, lower the batch per rank, or split the model further "
            "(tensor_parallel_size, ZeRO-3)")

    def _microbatch_peak(self, policy):
        """With num_microbatches > 1 the steps that run are the microbatches' (gradient
        accumulation): the planned temporaries of the largest microbatch's partial and final
        steps under recomputation ``policy``, the larger of the two."""
        rows = batching.microbatches(self.model.batch_size, self.microbatches)[0]
        model = self.model.at_batch(rows)
        if self.sync_batch_norm_world > 1 and has_training_batch_norm(model.mod):
            model = decompose_forward(model, self.sync_batch_norm_world)
        return max(plan_memory(build_train_step(model, self.loss, self.optimizer,
                                                accumulate=kind,
                                                **self._step_options(policy))[0],
                               self._passes(local=kind == "partial"), self._target)
                   for kind in ("partial", "final"))

    def _planned_peak(self):
        """The planned temporaries of the step that runs: with microbatches the largest of
        the microbatch steps compiled so far (the captured whole-batch step until the first
        step compiles them), else the captured step's."""
        micro = [v.compiled.planned_peak_bytes for v in self._variants.values()
                 if v.kind is not None]
        return max(micro) if micro else self.compiled.planned_peak_bytes

    def _step_options(self, recompute):
        """build_train_step's arguments from the plan (every batch size's step alike), with
        the recomputation policy ``recompute``."""
        return dict(nonfinite_guard=self._nonfinite_guard(), loss_weight=self._weighted_loss,
                    tensor_parallel=self.tp > 1, compute_dtype=self.compute_dtype,
                    reduce_dtype=self._reduce_dtype, loss_scale=self._scaler is not None,
                    # under ZeRO the distribution pass clips the shards (_passes)
                    clip=None if self._sharded_update() else self._clip,
                    recompute=recompute,
                    # plain SGD updates a sharded table's looked-up rows only (on the host:
                    # runtime/embedding_update.py)
                    local_grads=((tuple(self.ep_plan.names), self.world, self._on_host())
                                 if self.ep_plan is not None else None),
                    low_copies=self._holds_low_copies())

    def _holds_low_copies(self):
        """Whether the steps read 16-bit copies of the weights held between steps and written
        by the update (build_train_step's ``low_copies``): under mixed precision, not under
        ZeRO (its sharded update and gathers keep the casts in the step)."""
        return self.compute_dtype is not None and not self._sharded_update()

    def _on_host(self):
        return self._device.dlpack_device_type() == tvm.cpu().dlpack_device_type()

    def _sharded_update(self):
        """Whether ShardZeRO emits the update (ZeRO over data-parallel ranks)."""
        return self.data_parallel and self.zero_level > 0

    def _make_clip(self, max_grad_norm):
        """Clipping's view of the trained parameters (passes/clipping.py): which are
        tensor-parallel pieces; None without ``max_grad_norm``."""
        if max_grad_norm is None:
            return None
        split = set(self.tp_plan.placements) if self.tp_plan is not None else set()
        tables = set(self.ep_plan.shapes) if self.ep_plan is not None else set()
        names = trained_names(self.model)
        return Clip(float(max_grad_norm), tuple(n in split for n in names),
                    local=tuple(n in tables for n in names))

    def _compile_captured(self, model):
        """The gradient buckets, the StateLayout and the step compiled at the captured size."""
        # gradient buckets (parameter indices, in backward order) the distribution pass uses
        self.grad_buckets = (gradient_buckets(self.ir, self.bucket_bytes)
                             if self.data_parallel else [])
        # what this rank holds of the parameters and optimizer state (raf_dist.layout)
        self.layout = state_layout(self.signature.param_names, self.signature.param_specs,
                                   self.signature.state_names,
                                   self.zero_level if self.data_parallel else 0,
                                   self.world, self.dp_rank, self.grad_buckets,
                                   row_states=self.signature.row_states,
                                   local=self._local_params_indices(),
                                   sparse=[self.signature.param_names.index(n)
                                           for n in self.signature.sparse_names])
        self._step_passes = self._passes()  # again for each new batch size
        self.compiled = self._compile(self._cache_dir)
        self._vm = relax.VirtualMachine(self.compiled.executable, self._device)
        self._vms = [self._vm]  # every step VM, for profile (one per batch size seen)
        # one compiled step per batch size (rows on this rank) seen, the captured one first
        self.batch_size = model.batch_size
        self._variants = {self.batch_size: batching.StepVariant(
            self.batch_size, model, self.signature, self.compiled, self._vm["train_step"])}
        self._models = {self.batch_size: model}  # the model captured at each size

    def _initial_params(self, model):
        """{name: array} of the trained parameters' start: dp rank 0's on every dp rank,
        whatever each rank's seed."""
        init = {n: np.ascontiguousarray(model.init_params[n])
                for n in self.signature.param_names}
        if self.data_parallel and self.world > 1:
            for name in self.signature.param_names:
                if self.ep_plan is not None and name in self.ep_plan.shapes:
                    continue  # this rank's rows of rank 0's table (_split_for_embeddings)
                init[name] = collectives.broadcast(init[name].copy(), root=0,
                                                   group=self.dp_group)
        return init

    def _local_params_indices(self):
        """The trained parameters this rank holds alone (its rows of the sharded tables):
        whole under ZeRO too (raf_dist.layout)."""
        tables = set(self.ep_plan.shapes) if self.ep_plan is not None else set()
        return [i for i, n in enumerate(self.signature.param_names) if n in tables]

    def _init_state(self, model, init):
        """The runtime tensors held between steps: parameters (this rank's flat padded
        shard under ZeRO-3), frozen parameters, optimizer states, buffers."""
        if self.layout.params_sharded:
            index = {n: i for i, n in enumerate(self.signature.param_names)}
            init = {n: self.layout.shard_param(index[n], a) if n in index else a
                    for n, a in init.items()}
        self._params = [tvm.runtime.tensor(init[n], self._device)
                        for n in self.signature.param_names]
        self._frozen = self._init_frozen(model)  # requires_grad=False: passed, never updated
        fresh = self.layout.zero_states(self.optimizer.initial_states_by_param(
            self.signature.param_names))
        self._states = [tvm.runtime.tensor(a, self._device) for a in fresh]
        self._buffers = self._init_buffers(model)
        self._low = self._low_copies()

    def _low_copies(self):
        """The 16-bit copies of the parameters the step reads and rewrites
        (signature.low_copies), cast from the parameters on the host: rounded to nearest
        even, as the step's own cast rounds (so a resumed run reads the bits an uninterrupted
        one would)."""
        return [tvm.runtime.tensor(self._params[i].numpy().astype(numpy_dtype(dtype)),
                                   self._device) for i, dtype in self.signature.low_copies]

    def fingerprint(self):
        """(digest, description): what every rank of a job must agree on before the first
        collective: the model (parameter names, shapes, dtypes; inputs), loss, optimizer,
        config and versions. The compiled step is a function of these."""
        signature = (held.full_signature(self) if self.ep_plan is not None
                     else self.signature)  # table-wise, the ranks hold other tables
        return agreement.fingerprint(dict(
            agreement.step_description(self), model=ckpt.model_description(signature),
            embedding_plan=self.ep_plan.describe() if self.ep_plan is not None else None))

    def _passes(self, local=False):
        """The plan as explicit pass arguments. ``local``: for a step without gradient
        collectives (the microbatches before the last)."""
        reduce = self.data_parallel and not local
        clip = self._clip if reduce and self.zero_level > 0 else None
        return step_passes(self.zero_level if reduce else 0, self.world if reduce else 1,
                           self.bucket_bytes, overlap=self.run_plan.overlap_comm,
                           group=self.dp_group, guard=self._guard_under_zero(),
                           tp_group=self.mesh.tp_group if self.tp > 1 else None,
                           sync_batch_norm_group=(self.dp_group if self.sync_batch_norm_world > 1
                                                  else None), clip=clip,
                           embedding_group=self._embedding_group())

    def _compile(self, cache_dir):
        """Under data parallelism every rank builds the same Trainer and compiles the same IR
        (it is SPMD), so on each host local rank 0 compiles into the cache and the other ranks
        load the artifact instead of repeating the work. Without data parallelism a Trainer
        is a local object (it may exist on some ranks only) and compiles on its own."""
        passes = self._step_passes
        target = self._target
        if not self.spmd:
            return compile_step(self.ir, passes=passes, target=target, cache_dir=cache_dir)
        if self.comm.local_rank == 0:
            compiled = compile_step(self.ir, passes=passes, target=target, cache_dir=cache_dir)
            self.comm.idle_barrier("the barrier after local rank 0 compiled the step")
            return compiled
        self.comm.idle_barrier("the barrier after local rank 0 compiled the step")
        return compile_step(self.ir, passes=passes, target=target, cache_dir=cache_dir)

    # ---- the loop -------------------------------------------------------------------------
    def step(self, x, y):
        """One optimizer step on this rank's slice of the global batch; returns the mean loss
        over the global batch (every rank's slice must have the captured shape)."""
        # stats()'s runtime_bytes: what the first step adds to the host's memory beyond its
        # planned temporaries (on a GPU those are the device's)
        with process_memory.first_run(
                self, lambda: 0 if device_lib.is_gpu(self._device) else self._planned_peak()):
            if self._profiling is not None and self._profiling.active:
                return self._profiling.step(self._run_step, self.step_count + 1, x, y)
            return self._run_step(x, y)

    def profile(self, steps: int, path) -> str:
        """Record the next ``steps`` calls to ``step`` — every kernel, BLAS call, collective
        start / wait (with bytes) and the step itself — and write them as a Chrome trace to
        ``path/trace-rank{R}.json`` when the last one ends (see raf_dist.profiler). Returns
        that file's path. Open it in Perfetto, or merge the ranks' files with
        ``python -m raf_dist.tools.timeline path``."""
        if self._profiling is not None:
            self._profiling.finish()  # a trace already being recorded is written as it is
        self._profiling = profiler.StepProfiler(list(self._vms), self.comm.rank, steps, path)
        return str(self._profiling.path)

    def _run_step(self, x, y):
        """``step`` without the profiler."""
        inputs = x if isinstance(x, (tuple, list)) else (x,)
        if len(inputs) != self.signature.num_inputs:
            raise ValueError(f"step() got {len(inputs)} inputs; the model was captured with "
                             f"{self.signature.num_inputs}")
        # any leading (batch) dimension: the captured shapes with this batch's rows, checked
        # before any work (training/batch_size.py)
        rows = batching.leading_rows(inputs, self.signature.input_specs, self.batch_size)
        for i, (a, spec) in enumerate(zip(inputs, self.signature.input_specs)):
            check_array(a, batching.batched_spec(spec, rows, self.batch_size), f"input {i}")
        check_array(y, batching.batched_target_spec(self.signature.target_spec, rows,
                                                     self.batch_size), "target")
        if self._classes is not None:  # before any collective: the message names the value
            check_targets(y, self._classes)
        # every id a row of its table: this rank's verdict, raised on every rank together
        # with the rows' exchange (_rows_per_rank), before any table exchange
        bad_ids = self._check_ids.message(inputs, rows) if self._check_ids is not None else None
        pieces = batching.microbatches(rows, self.microbatches)
        # local work, before collectives: the compiled steps for these sizes
        variants = ([self._step_variant(r, "partial") for r in pieces[:-1]]
                    + [self._step_variant(pieces[-1], "final")] if len(pieces) > 1
                    else [self._step_variant(rows) if rows else None])
        # the step running and the last one completed: a failure message is unambiguous
        # (checkpoints are named by the last completed step); from its first collective on,
        # an exception on this rank ends the job (Communicator.collective_work)
        with self.comm.collective_work(
                f"step {self.step_count + 1} (last completed: {self.step_count})", self.spmd):
            loss = self._execute(inputs, y, rows, pieces, variants, bad_ids)
        self.comm.activity = f"work between steps (last completed: {self.step_count})"
        return loss

    def _execute(self, inputs, y, rows, pieces, variants, bad_ids=None):
        """The step's collectives and compiled functions on checked inputs; the loss.
        ``bad_ids``: this rank's ids check failed (the message), raised on every rank."""
        began = time.perf_counter()
        # a small collective under data parallelism
        rows_per_rank = self._rows_per_rank(rows, bad_ids)
        # the optimizer's own step count (Adam's bias correction): skipped steps do not count
        hypers, lr = self._next_hypers()
        if self._scaler is not None:
            hypers[GRAD_UNSCALE] = 1.0 / self._scaler.scale
        hyper_args = [tvm.runtime.tensor(np.array(hypers[h], dtype=self._hyper_dtype), self._device)
                      for h in self.signature.hyper_names]
        before = self._traffic() if self.spmd else None
        accumulators, start = None, 0
        for m, (variant, piece) in enumerate(zip(variants, pieces)):
            args = self._step_inputs(variant, inputs, y, start, piece, rows_per_rank,
                                     m if len(pieces) > 1 else None)
            start += piece
            if variant.kind == "partial":  # gradients and loss added into the accumulators
                if accumulators is None:
                    accumulators = self._zero_accumulators()
                out = variant.step_fn(*args, *self._params, *accumulators, *self._buffers,
                                      *self._low)
                n = len(self._params)  # out: (loss so far, *gradient sums, *new buffers)
                accumulators = [out[1 + i] for i in range(n)] + [out[0]]
                self._buffers = [out[1 + n + i] for i in range(len(self._buffers))]
                continue
            out = variant.step_fn(*args, *self._params, *self._states, *hyper_args,
                                  *(accumulators or ()), *self._buffers, *self._low)
        if before is not None:
            after = self._traffic()
            self._comm_last_step, self._comm_by_axis = (
                {k: a[k]["bus_bytes"] - b[k]["bus_bytes"] for k in a
                 if a[k]["calls"] > b[k]["calls"]} for a, b in zip(after, before))
        n = len(self._params)
        # the step wrote the new values into the tensors it was given (UpdateInPlace) and
        # returns them; an output it could not prove safe to update in place is a new tensor
        self._params = [out[1 + i] for i in range(n)]
        self._states = [out[1 + n + i] for i in range(len(self._states))]
        first_buffer = 1 + n + len(self._states)
        self._buffers = [out[first_buffer + i] for i in range(len(self._buffers))]
        first_copy = first_buffer + len(self._buffers)
        self._low = [out[first_copy + i] for i in range(len(self._low))]
        self._keep_rank0_buffers()
        loss = self._loss_of(out[0])
        self._last_lr = lr
        if self._scaler is not None:
            loss = self._scaled_step(loss)
        elif not math.isfinite(loss):
            self._nonfinite_step(loss)
        self.step_count += 1
        self._metrics.record(self.step_count, loss, lr, time.perf_counter() - began,
                             self._flops_per_row * rows, sum(rows_per_rank),
                             grad_norm=self._last_grad_norm, loss_scale=self.loss_scale)
        return loss

    def _traffic(self):
        """(bus bytes by collective kind, by mesh axis) so far, as comm_counters gives them."""
        total = collectives.comm_counters()
        if self.tp == 1:
            return total, {}
        axes = {}
        for axis, group in (("tp", self.mesh.tp_group), ("dp", self.mesh.dp_group)):
            counters = collectives.comm_counters(group=group)
            axes[axis] = {"calls": sum(c["calls"] for c in counters.values()),
                          "bus_bytes": sum(c["bus_bytes"] for c in counters.values())}
        return total, axes

    def _step_inputs(self, variant, inputs, y, start, rows, rows_per_rank, microbatch):
        """The data arguments of one step call: rows [start, start + rows) of every batched
        input and of the target (all of them when ``microbatch`` is None), the dropout masks,
        the frozen parameters, the loss weight (this piece's share of the global batch)."""
        signature, captured = variant.signature, self.batch_size

        def piece(array, spec):
            array = np.asarray(array)
            if microbatch is not None and len(spec[0]) and int(spec[0][0]) == captured:
                return array[start:start + rows]
            return array

        args = [self._to_device(piece(a, spec), vspec, f"input {i}") for i, (a, spec, vspec)
                in enumerate(zip(inputs, self.signature.input_specs, signature.input_specs))]
        args += [tvm.runtime.tensor(m, self._device) for m in self.dropout_masks(
            self.step_count + 1, rows, microbatch)]
        args += self._frozen
        target = y
        if microbatch is not None:  # this microbatch's share of the target's rows
            target = batching.target_piece(y, start, rows, batching.target_rows_per_row(
                self.signature.target_spec, captured))
        args.append(self._to_device(target, signature.target_spec, "target"))
        if signature.loss_weight_dtype is not None:  # this piece's share of the global batch
            weight = batching.loss_weight(rows, rows_per_rank)
            if self._scaler is not None:  # and the loss scale (a power of two: exact)
                weight *= self._scaler.scale
            args.append(tvm.runtime.tensor(np.array(weight, dtype=signature.loss_weight_dtype),
                                           self._device))
        return args

    def _zero_accumulators(self):
        """Gradient accumulators (one per trained parameter, as this rank holds it) and the
        loss accumulator, zero at the start of a step."""
        specs = self.signature.param_specs
        return ([tvm.runtime.tensor(np.zeros(s, d), self._device) for s, d in specs]
                + [tvm.runtime.tensor(np.zeros((), self._hyper_dtype), self._device)])

    # ---- non-finite losses and gradients (training/nonfinite.py) ---------------------------
    def _nonfinite_guard(self):
        """What the step checks before it updates (``nonfinite_guard``)."""
        return nonfinite_guard(self.zero_level if self.data_parallel else 0,
                               self.world if self.data_parallel else 1, self.nonfinite)

    def _nonfinite_step(self, loss):
        """The step returned a NaN/inf loss (the step makes it NaN when a gradient is not
        finite). The loss is the global one, so every rank takes the same branch."""
        step = self.step_count + 1
        if self.update_guarded:
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                _LOG.warning("step %d: the loss or a gradient is not finite (loss %s); the "
                             "update was skipped on every rank (nonfinite='skip')", step, loss)
                return
            raise raised_on_every_rank(FloatingPointError(
                f"step {step}: the loss or a gradient is not finite (loss {loss}); the update "
                "was not applied, parameters and optimizer state are unchanged. Check this "
                "step's inputs and the learning rate, or pass Trainer(nonfinite='skip') to skip "
                "such steps"))
        self.step_count += 1  # the update ran (ZeRO): the step happened
        raise raised_on_every_rank(FloatingPointError(
            f"step {step}: the loss is not finite ({loss}); under ZeRO the parameters were "
            "already updated with its gradients. Restore the last checkpoint, and check this "
            "step's inputs and the learning rate"))

    def _scaled_step(self, scaled_loss):
        """precision="fp16": the loss unscaled, and the scale updated as GradScaler does
        (runtime/loss_scale.py). A NaN loss is a step the guard skipped: its gradients (or the
        loss) overflowed at this scale, a routine event while the scale settles. Only at a
        scale of 1 or below (DeepSpeed's min_loss_scale) do the gradients overflow float16
        unscaled: that is a divergence, and ``nonfinite`` decides (``_overflowed``)."""
        scale = self._scaler.scale
        finite = math.isfinite(scaled_loss)
        if self._overflowed(finite):
            return scaled_loss
        if finite:
            return scaled_loss / scale
        self._nonfinite_step(scaled_loss)  # raises, or counts the skip and warns
        return scaled_loss

    def _guard_under_zero(self):
        """ShardZeRO's guard (every rank's gradients finite before any update): asked for
        by nonfinite="skip", and needed by loss scaling (an overflow is skipped)."""
        return self.nonfinite == "skip" or self._scaler is not None

    @property
    def update_guarded(self) -> bool:
        """Whether the compiled step skips its own update on a non-finite gradient: always
        without ZeRO; under ZeRO with nonfinite="skip" or loss scaling (ShardZeRO's guard,
        which waits for every gradient before any update)."""
        return not (self.data_parallel and self.zero_level > 0) or self._guard_under_zero()

    def _init_frozen(self, model):
        """Runtime tensors of the frozen parameters (full on every rank: rank 0's values)."""
        frozen = []
        for name in self.signature.frozen_names:
            value = np.ascontiguousarray(model.init_params[name]).copy()
            if self.data_parallel and self.world > 1:
                value = collectives.broadcast(value, root=0, group=self.dp_group)
            frozen.append(tvm.runtime.tensor(value, self._device))
        return frozen

    def _in_model_order(self, trained):
        """{name: value} of the trained parameters plus the frozen ones, ordered as the
        model's parameters (``named_parameters()`` for a PyTorch model)."""
        values = dict(trained)
        values.update(zip(self.signature.frozen_names, self._frozen))
        return {name: values[name] for name in self.model.param_names}

    def dropout_masks(self, step, rows=None, microbatch=None):
        """The dropout masks of 1-based ``step`` on this rank, in execution order: 0 or
        1/(1-p) per element, drawn from a generator seeded by (seed, rank, step), so a run is
        reproducible and every rank drops different elements of its own rows. ``rows``: the
        step's batch size on this rank (default: the captured one); the masks have the shapes
        of the model at that size."""
        # tp ranks of one dp index compute the same replicated activations: the same masks
        rank = self.mesh.dp_rank if self.spmd else self.comm.rank
        seed = [self.seed, rank, int(step)] + ([] if microbatch is None else [int(microbatch)])
        rng = np.random.default_rng(seed)
        masks = []
        specs = (self.signature.dropout_specs if rows is None
                 else self._model_at(rows).dropout_specs)
        for shape, dtype, rate in specs:
            keep = rng.random(shape) >= rate
            masks.append((keep / (1.0 - rate)).astype(dtype))
        return masks

    def predict(self, x):
        """Forward pass with the current parameters on any number of rows (runtime/predict.py:
        pieces of the captured batch size, one compiled forward per piece size); ``x`` one
        array or one per input; returns the outputs as one numpy array. Under ZeRO-3 the
        parameters are gathered first, and with sharded embedding tables the lookups exchange
        with the tables' holders, so every rank must call it (with the same rows)."""
        specs = self.signature.input_specs
        inputs, rows = predict_lib.check_rows(x, specs, self.batch_size)
        sharing = self.ep_plan is not None and self.world > 1
        if sharing:  # before any other collective: the same rows everywhere, every id good
            self._agree_on_predict_rows(inputs, rows)
        with self.comm.collective_work("predict", self.spmd):
            params = list(self._in_model_order(zip(self.signature.param_names,
                                                    self._params)).values())
            if self.zero_level == 3:  # sharded between steps: gather this rank's parameters
                local = self._in_model_order(self._local_params())
                params = [tvm.runtime.tensor(local[n], self._device)
                          for n in self.model.param_names]

            def run_piece(pieces, rows):
                forward, model = self._forwards.at(rows)
                evaluation = model.forward_eval is not None  # running statistics (BN eval)
                no_dropout = [] if evaluation else [
                    tvm.runtime.tensor(np.ones(s, d), self._device)
                    for s, d, _ in model.dropout_specs]
                out = forward(*[tvm.runtime.tensor(p, self._device) for p in pieces],
                              *no_dropout, *params, *(self._buffers if evaluation else ()))
                if not evaluation and self._buffers:  # training forward: (output, *buffers)
                    out = out[0]
                out = out.numpy()
                if self.tp_plan is not None and self.tp_plan.output_split:  # classes over tp
                    out = self._gather_classes(out)
                return out

            respecialize = self.model.respecialize is not None
            if not sharing:
                return predict_lib.in_pieces(inputs, specs, self.batch_size, respecialize,
                                             run_piece)
            # sharded tables: each dp rank computes an equal share of the rows (the last
            # share padded), its lookups exchanged with the holders as in a step; the shares
            # are allgathered
            share = -(-rows // self.world)
            start = self.dp_rank * share
            mine = predict_lib.rows_of(inputs, specs, self.batch_size, start,
                                       max(0, min(share, rows - start)), share)
            out = np.ascontiguousarray(predict_lib.in_pieces(mine, specs, self.batch_size,
                                                             respecialize, run_piece))
            shares = collectives.allgather(out.reshape(-1), group=self.dp_group)
            return shares.reshape((self.world * out.shape[0],) + out.shape[1:])[
                :rows * (out.shape[0] // share)]

    def _agree_on_predict_rows(self, inputs, rows):
        """``predict`` with sharded tables, before any exchange: this rank checks every id of
        ``inputs`` (at the captured batch size: the step's compiled check) and the dp ranks
        exchange their row counts, verdicts and a checksum of their rows in one small
        allgather; a bad id, or ranks with other rows, is a ValueError on every rank."""
        specs = self.signature.input_specs
        bad_ids = None
        for start in range(0, rows, self.batch_size):
            count = min(self.batch_size, rows - start)
            bad_ids = bad_ids or self._check_ids.message(
                predict_lib.rows_of(inputs, specs, self.batch_size, start, count,
                                    self.batch_size), self.batch_size)
        checksum = 0
        for array in inputs:
            checksum = zlib.crc32(np.ascontiguousarray(array).view(np.uint8), checksum)
        rows_per_rank, bad, checksums = zip(*batches.allgather_ints(
            self.dp_comm, [rows, int(bad_ids is not None), checksum],
            "the exchange of every rank's rows before predict()"))
        if bad_ids is None and not any(bad) and (len(set(rows_per_rank)) > 1
                                                 or len(set(checksums)) > 1):
            raise raised_on_every_rank(ValueError(
                f"predict() with sharded embedding tables got other rows on other ranks "
                f"({list(rows_per_rank)} rows by rank, {len(set(checksums))} different "
                "contents): every rank must pass the same rows (each computes a share of "
                "them, looking up the others' tables)"))
        self._check_sharded_tables_batch(rows_per_rank, bad, bad_ids)

    def _gather_classes(self, piece):
        """The whole output from every tp rank's slice of its last (class) dimension."""
        piece = np.ascontiguousarray(piece)
        flat = collectives.allgather(piece.reshape(-1), group=self.mesh.tp_group)
        return np.concatenate(np.split(flat.reshape((self.tp,) + piece.shape), self.tp),
                              axis=-1).reshape(piece.shape[:-1] + (piece.shape[-1] * self.tp,))[
            ..., :self.tp_plan.output_classes]  # a padded vocabulary's padding cut off

    # ---- any batch size (training/batch_size.py) --------------------------------------------
    @property
    def compiled_batch_sizes(self) -> list:
        """The batch sizes (rows on this rank) a training step has been compiled for."""
        return sorted(self._variants)

    def _model_at(self, rows):
        """The model captured with ``rows`` rows (cached)."""
        rows = int(rows)
        if rows not in self._models:
            self._models[rows] = self.model.at_batch(rows)
        return self._models[rows]

    def _step_variant(self, rows, kind=None):
        """The compiled step for ``rows`` rows on this rank: built the first time a batch of
        that size comes (captured again, differentiated, compiled with the same passes); it
        takes the same parameter, state and buffer tensors as every other size. Local work:
        under data parallelism the ranks may be at different sizes, so there is no barrier.
        ``kind``: "partial" / "final" for the microbatches of gradient accumulation
        (build_train_step's ``accumulate``)."""
        key = rows if kind is None else (rows, kind)
        variant = self._variants.get(key)
        if variant is not None:
            return variant
        _LOG.info("batch size %d on rank %d (the step was captured with %d): compiling a step "
                  "for this size; one compiled step per batch size, all sharing the "
                  "parameters and optimizer state", rows, self.comm.rank, self.batch_size)
        model = self._model_at(rows)
        step_model = model
        if self.sync_batch_norm_world > 1 and has_training_batch_norm(model.mod):
            step_model = decompose_forward(model, self.sync_batch_norm_world)
        ir, signature = build_train_step(step_model, self.loss, self.optimizer,
                                         accumulate=kind, **self._step_options(self.recompute))
        batching.check_same_state(self.signature, signature, rows)
        if (self.data_parallel and kind != "partial"
                and gradient_buckets(ir, self.bucket_bytes) != self.grad_buckets):
            raise ValueError(f"the step for batch size {rows} groups the gradients into other "
                             "buckets than the captured step; its collectives would not match "
                             "the other ranks'. Use the captured batch size")
        passes = self._step_passes if kind != "partial" else self._passes(local=True)
        compiled = compile_step(ir, passes=passes, target=self._target, cache_dir=self._cache_dir)
        vm = relax.VirtualMachine(compiled.executable, self._device)
        self._vms.append(vm)
        if self._profiling is not None:  # a size first seen while profiling is recorded too
            self._profiling.attach(vm)
        variant = batching.StepVariant(rows, model, signature, compiled, vm["train_step"], kind)
        self._variants[key] = variant
        return variant

    def _rows_per_rank(self, rows, bad_ids=None):
        """Every rank's rows in this step (one small allgather under data parallelism). Raises
        on every rank together when a rank has none, when synchronized batch norm would
        see different row counts (its statistics assume equal ones), and with sharded
        embedding tables when the counts differ (the exchanges' sizes are compiled in) or a
        rank's batch has an id outside its table (``bad_ids``, that rank's message)."""
        if self.data_parallel and self.world > 1 and self.ep_plan is not None:
            rows_per_rank, bad = batches.allgather_rows_and_flags(self.dp_comm, rows,
                                                                  int(bad_ids is not None))
            self._check_sharded_tables_batch(rows_per_rank, bad, bad_ids)
        elif self.data_parallel and self.world > 1:
            rows_per_rank = batches.allgather_rows(self.dp_comm, rows)
        else:
            rows_per_rank = [int(rows)]
        batches.check_rows_per_rank(rows_per_rank, self.dp_rank)
        if self.sync_batch_norm_world > 1 and len(set(rows_per_rank)) > 1:
            raise raised_on_every_rank(NotImplementedError(
                f"sync_batch_norm with different rows per rank ({rows_per_rank}) is not "
                "supported: the synchronized statistics assume every rank holds as many rows. "
                "Use raf_dist.data.shard(..., drop_last=True) or turn sync_batch_norm off"))
        return rows_per_rank

    def _check_sharded_tables_batch(self, rows_per_rank, bad, bad_ids):
        """The rows' exchange told every rank the others' rows and ids verdicts: raise the
        same way on every rank (embedding_parallel)."""
        if bad_ids is not None:
            raise raised_on_every_rank(ValueError(bad_ids))
        if any(bad):
            ranks = [r for r, flag in enumerate(bad) if flag]
            raise raised_on_every_rank(ValueError(
                f"the batch of rank(s) {ranks} has an id outside its embedding table (the "
                "error there names the table and the id); nothing was exchanged"))
        if len(set(rows_per_rank)) > 1:
            raise raised_on_every_rank(ValueError(
                f"embedding_parallel with different rows per rank ({rows_per_rank}) is not "
                "supported: the tables' exchanges are compiled for equal batches. Use "
                "raf_dist.data.shard(..., drop_last=True)"))

    def _to_device(self, array, spec, what):
        return to_device(array, spec, what, self._device)

    @property
    def _step_fn(self):
        """The VM function of the step at the captured batch size (tests wrap it to inject
        failures inside a step)."""
        return self._variants[self.batch_size].step_fn

    @_step_fn.setter
    def _step_fn(self, function):
        self._variants[self.batch_size].step_fn = function

    @property
    def num_grad_buckets(self):
        """Collectives per step for gradients (0 without data parallelism)."""
        return len(self.grad_buckets)

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self):
        """Full parameters by name (numpy arrays, true shapes). Under ZeRO-3 or tensor
        parallelism parameters are sharded, so this gathers them: every rank must call it."""
        local = {n: ckpt.host_array(v) for n, v in self._in_model_order(
            self._local_params()).items()}  # frozen ones too, in named_parameters() order
        if self.ep_plan is not None:  # the tables from the dp ranks (whole on every tp rank)
            local = {n: held.full_table(self.ep_plan, n, v, self.dp_group)
                     for n, v in local.items()}
        if self.tp == 1:
            return local
        return {n: held.full_parameter(self.tp_plan, n, v, self.mesh.tp_group, self.tp)
                for n, v in local.items()}

    def _local_params(self):
        """{name: array} of the trained parameters this rank computes with: whole (gathered
        over the dp ranks under ZeRO-3), this tp rank's pieces under tensor parallelism."""
        if self.layout.params_sharded:
            return {name: p.numpy() if self.layout.is_local(i) else
                    held.gather_shards(p, shape, self.world, self.dp_group)
                    for i, (name, p, (shape, _)) in enumerate(
                        zip(self.signature.param_names, self._params,
                            self.signature.param_specs))}
        return {name: p.numpy() for name, p in zip(self.signature.param_names, self._params)}

    def buffers_dict(self) -> dict:
        """Every buffer of the model by name, as ``module.named_buffers()`` lists them (numpy
        arrays): the running statistics the step carries (the same on every rank: rank 0's
        under data parallelism) and the constants folded into the IR."""
        carried = {name: t.numpy() for name, t in zip(self.signature.buffer_names, self._buffers)}
        order = self.model.buffer_order or list(carried)
        return {name: carried[name] if name in carried else self.model.constant_buffers[name]
                for name in order}

    def _init_buffers(self, model):
        """Runtime tensors of the buffers the step carries, rank 0's values on every rank."""
        buffers = []
        for name in self.signature.buffer_names:
            value = np.array(model.init_buffers[name], order="C")  # 0-d stays 0-d
            if self.data_parallel and self.world > 1:  # world rank 0's start everywhere, as
                collectives.broadcast(value.reshape(-1), root=0)  # the pipeline executor's
            buffers.append(tvm.runtime.tensor(value, self._device))
        return buffers

    def _keep_rank0_buffers(self):
        """DDP's broadcast_buffers over the dp group (as the pipeline executor's): every rank
        normalized with its own batch statistics, dp rank 0's running statistics are kept
        (with sync_batch_norm they are equal already; the broadcast keeps them bit-identical)."""
        if not (self.data_parallel and self.world > 1 and self._buffers):
            return
        for i, tensor in enumerate(self._buffers):
            host = np.array(tensor.numpy(), order="C")
            collectives.broadcast(host.reshape(-1), root=0, group=self.dp_group)  # fills host
            self._buffers[i] = tvm.runtime.tensor(host, self._device)

    def optimizer_state_dict(self):
        """Optimizer state as {param name: {state name: array}}, full shapes. Under ZeRO the
        state is sharded, so this gathers it: every rank must call it."""
        states = held.full_optimizer_states(self.layout, self._states, self.dp_group,
                                            self.tp_plan, self.mesh.tp_group, self.tp)
        if self.ep_plan is None:
            return states
        return {p: {s: held.full_table(self.ep_plan, p, v, self.dp_group) for s, v in d.items()}
                for p, d in states.items()}

    def _unpack_states(self):
        """{(param, state): array} of what this rank holds."""
        return self.layout.unpack_states([t.numpy() for t in self._states])

    def _pack_states(self, by_key):
        """Runtime tensors of the step's state arguments from {(param, state): array}."""
        return [tvm.runtime.tensor(a, self._device) for a in self.layout.pack_states(by_key)]

    # ---- checkpoints (the files and what each rank reads and writes: raf_dist.checkpoint) ----
    def save_checkpoint(self, path, extra=None, keep=2):
        """Write this rank's shards of every parameter and optimizer state under ``path``
        (see raf_dist.checkpoint for the layout); ``extra`` (JSON-serialisable, e.g. the data
        position) comes back from load_checkpoint. Atomic: ``path/latest`` moves to the new
        checkpoint only once every rank's file is on disk. Keeps the newest ``keep``
        checkpoints. Returns the checkpoint's directory. Every rank must call it."""
        if self.tp > 1 or self.ep_plan is not None:  # the full tensors, as any layout writes
            full = self.state_dict()  # them (full_train_state)
            states = {(p, s): v for p, d in self.optimizer_state_dict().items()
                      for s, v in d.items()}
            return ckpt.save(held.full_train_state(self, full), path,
                             [full[n] for n in self.signature.param_names], states, extra, keep,
                             buffers=self.buffers_dict())
        return ckpt.save(self._train_state(), path, self._params, self._unpack_states(), extra,
                         keep, buffers=self.buffers_dict())

    def _train_state(self):
        """What a checkpoint of this executor's own layout writes and reads."""
        return ckpt.TrainState.of(self.comm, self.world, self.zero_level, self.signature,
                                  self.step_count, self.seed, self.config, self.loss,
                                  self.optimizer, self.model, self._frozen,
                                  shared=self.data_parallel or self.local,
                                  loop=self.loop_state())

    def load_checkpoint(self, path):
        """Load the newest checkpoint under ``path`` (or the checkpoint directory ``path``),
        whatever world size and ZeRO level wrote it: each rank reads the element ranges it
        now holds. Returns the ``extra`` given to save_checkpoint. Every file's size, the
        sha256 of each file a rank reads, and the model's names, shapes and dtypes are checked
        first, on every rank, and any problem raises the same CheckpointError everywhere
        before any data moves; nothing on disk is modified. Every rank must call it."""
        if self.tp > 1 or self.ep_plan is not None:  # full tensors in (full_train_state),
            # this rank's pieces kept
            params, states, buffers, frozen, meta = ckpt.load(held.full_train_state(self, {}),
                                                              path)
            params, states, frozen = self._pieces(params, states, frozen)
        else:
            params, states, buffers, frozen, meta = ckpt.load(self._train_state(), path)
        self._frozen = [tvm.runtime.tensor(frozen[n], self._device) if n in frozen else t
                        for n, t in zip(self.signature.frozen_names, self._frozen)]
        self._params = [tvm.runtime.tensor(p, self._device) for p in params]
        self._buffers = [tvm.runtime.tensor(buffers[n], self._device)
                         for n in self.signature.buffer_names]
        self._states = self._pack_states(states)
        self._low = self._low_copies()
        self.step_count, self.seed = int(meta["step"]), int(meta["seed"])
        self.load_loop_state(meta.get("loop", {}))
        return meta.get("extra")

    def _pieces(self, params, states, frozen):
        """This rank's pieces of full parameters (signature order), optimizer states and
        frozen parameters: its tp piece, then its dp shard where ZeRO shards them."""
        def piece(name, array):
            array = np.asarray(array)
            if self.tp_plan is not None:  # this tp rank's piece (a table stays whole)
                array = self.tp_plan.local_shard(name, array, self.mesh.tp_rank)
            if self.ep_plan is not None:  # this dp rank's rows of a sharded table
                array = self.ep_plan.local_shard(name, array, self.dp_rank)
            return array

        names = self.signature.param_names
        index = {n: i for i, n in enumerate(names)}
        params = [piece(n, p) for n, p in zip(names, params)]
        if self.layout.params_sharded:
            params = [self.layout.shard_param(i, p) for i, p in enumerate(params)]
        states = {k: piece(k[0], v) for k, v in states.items()}
        if self.layout.states_sharded:
            states = {k: self.layout.shard_param(index[k[0]], v) for k, v in states.items()}
        return params, states, {n: piece(n, v) for n, v in frozen.items()}

    def stats(self):
        """What this rank holds between steps (parameters, optimizer state), the gradient
        bytes that outlive their bucket's collective, the step's planned temporaries and the
        bus bytes it sent in the last step by collective kind."""
        return process_memory.with_total({
            "param_bytes": sum(nbytes(p) for p in self._params + self._frozen),
            # levels 0-1 keep every full gradient until backward ends; 2-3 keep shards
            "grad_bytes": self.layout.grad_bytes(),
            "optimizer_state_bytes": sum(nbytes(s) for s in self._states),
            # mixed precision: the 16-bit copies of the weights the steps read (low_copies)
            "low_param_bytes": sum(nbytes(t) for t in self._low),
            # parameters, frozen parameters, buffers, optimizer state and the 16-bit copies
            # held between steps
            "held_bytes_by_dtype": bytes_by_dtype(self._params + self._frozen + self._buffers
                                                  + list(self._states) + self._low),
            "planned_peak_bytes": self._planned_peak(),
            "comm_bytes_last_step": dict(self._comm_last_step),
            # the same bus bytes by mesh axis (with tensor parallelism): {"tp": ..., "dp": ...}
            "comm_bytes_by_axis": dict(self._comm_by_axis),
            **device_lib.memory_stats(self._device),  # GPU: used / total (pynvml)
            **process_memory.overheads(),  # compiled code, libraries loaded
        })
