"""The SPMD executor: one compiled training step per batch size, run by every rank of the job
together (data parallel, ZeRO, tensor parallel) or by one rank alone (DESIGN.md section 2).

runtime/spmd_build.py builds the step (the tp split, the IR, the recomputation budget, the
compile, batch-size variants); this module runs it on the VM: microbatch accumulation, the
non-finite policy, the state held between steps. Parameters and optimizer state stay in
runtime tensors between steps, held as the ``StateLayout`` says (``raf_dist.layout``). The
frame (runtime/executor.py) holds what both executors share. ``raf_dist.Trainer`` builds one
(``pipeline_parallel_size`` 1) and forwards its surface to it.
"""
import logging
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from .. import checkpoint as ckpt
from .. import process_memory
from ..compiler.step_passes import forward_passes
from ..distributed import collectives
from ..distributed.communicator import raised_on_every_rank
from ..training import batch_size as batching
from ..training.loss import num_classes
from ..training.step import GRAD_UNSCALE
from . import agreement, batches
from . import embedding_update  # noqa: F401  (registers the sparse table update it runs)
from . import metrics as metrics_lib
from . import predict as predict_lib
from . import spmd_state
from . import state as held
from .executor import ExecutorFrame
from .plan import RunPlan
from .spmd_build import SPMDBuilder
from .tensors import bytes_by_dtype, nbytes, numpy_dtype

_LOG = logging.getLogger("raf_dist")


class SPMDExecutor(ExecutorFrame):
    """Train ``model`` (a :class:`raf_dist.model.Model`) with ``loss`` and ``optimizer``.

    ``step(x, y)`` takes this rank's slice of the global batch (numpy arrays) and returns the
    mean loss as a float; ``state_dict()`` returns the full parameters as numpy arrays.
    """

    def __init__(self, model: Any, loss: str, optimizer: Any, device: str, plan: RunPlan,
                 mesh: Any, comm: Any, cache_dir: Any = None, seed: int = 0,
                 nonfinite: str = "raise", tensor_parallel_plan: Any = None,
                 precision: str = "fp32", grad_reduce_dtype: str = "float32",
                 lr_schedule: Any = None, log_every: int = 0,
                 max_grad_norm: Optional[float] = None, embedding_plan: Any = None) -> None:
        """See raf_dist.Trainer: the arguments are checked and the ranks agreed (the front
        did both); ``plan`` is the config read once, ``mesh`` the mesh it runs on."""
        super().__init__(model, loss, optimizer, device, plan, mesh, comm, cache_dir=cache_dir,
                         seed=seed, nonfinite=nonfinite, precision=precision,
                         grad_reduce_dtype=grad_reduce_dtype, lr_schedule=lr_schedule,
                         max_grad_norm=max_grad_norm)
        builder = self.builder = SPMDBuilder(
            model, loss, optimizer, plan, mesh, comm, self._device, self._target,
            compute_dtype=self.compute_dtype, loss_scale=self._scaler is not None,
            nonfinite=nonfinite, max_grad_norm=max_grad_norm,
            grad_reduce_dtype=grad_reduce_dtype, cache_dir=cache_dir, dp_rank=self.dp_rank)
        model = self.model = builder.split(tensor_parallel_plan, embedding_plan)
        self.tp_plan, self.ep_plan = builder.tp_plan, builder.ep_plan
        step = builder.build_step()
        self.ir, self.signature, self.recompute = step.ir, step.signature, step.recompute
        # for the target check: the model's classes (all of them under tensor parallelism)
        self._classes = num_classes(self.full_model.forward, self.loss)
        self._hyper_dtype = (self.signature.param_specs[0][1] if self.signature.param_specs
                             else "float32")
        # from the fingerprint check on the ranks meet in collectives (and compile barriers):
        # an exception on one rank ends the job (Communicator.collective_work)
        with comm.collective_work("building a Trainer (compiling its step)", self.parallel.spmd):
            if self.parallel.spmd:
                agreement.check_fingerprints(comm, *self.fingerprint())
            built = self._built = builder.compile_captured(step)
            self.grad_buckets, self.layout = built.grad_buckets, built.layout
            self.compiled = built.compiled
            self._vm = builder.vm(self.compiled)
            self._vms = [self._vm]  # every step VM, for profile (one per batch size seen)
            # one compiled step per batch size (rows on this rank) seen, the captured first
            self.batch_size = model.batch_size
            self._variants = {self.batch_size: batching.StepVariant(
                self.batch_size, model, self.signature, self.compiled, self._vm["train_step"])}
            self._models = {self.batch_size: model}  # the model captured at each size
            init = spmd_state.initial_params(self, model)
        process_memory.after_compile()  # the compile's transient gone before the states come
        self._init_state(model, init)
        del init
        self._keep_shapes_only()
        # FLOPs scale with the rows (every matmul / convolution has the batch in it)
        self._flops_per_row = metrics_lib.function_flops(self.ir["train_step"]) / self.batch_size
        self._metrics = metrics_lib.StepMetrics(
            metrics_lib.tokens_per_row(self.signature.input_specs), log_every)
        self._forwards = predict_lib.Forwards(  # predict's compiled forwards by rows
            self._model_at, forward_passes(self.mesh.tp_group if self.parallel.tp > 1 else None,
                                           builder.embedding_group(),
                                           self.mesh.cp_group if self.parallel.cp > 1
                                           else None,
                                           self.mesh.tp_group
                                           if self.parallel.sequence_parallel else None),
            self._target, self._device, cache_dir, self.compute_dtype)

    # ---- construction, in steps --------------------------------------------------------------
    def _keep_shapes_only(self) -> None:
        """Once the runtime tensors hold the parameters, the models this executor keeps
        (for their IR, shapes and recapture) let go of their initial values: the process
        holds one copy of the weights (Model.without_values)."""
        lean: Dict[int, Any] = {}

        def shapes_only(model: Any) -> Any:
            if id(model) not in lean:
                lean[id(model)] = model.without_values()
            return lean[id(model)]

        self.model, self.full_model = shapes_only(self.model), shapes_only(self.full_model)
        self.builder.model = self.model
        self._models = {rows: shapes_only(m) for rows, m in self._models.items()}
        for variant in self._variants.values():
            variant.model = shapes_only(variant.model)

    def _init_state(self, model: Any, init: Dict[str, np.ndarray]) -> None:
        """The runtime tensors held between steps: parameters (this rank's flat padded
        shard under ZeRO-3), frozen parameters, optimizer states, buffers."""
        if self.layout.params_sharded:
            index = {n: i for i, n in enumerate(self.signature.param_names)}
            init = {n: self.layout.shard_param(index[n], a) if n in index else a
                    for n, a in init.items()}
        self._params = [tvm.runtime.tensor(init[n], self._device)
                        for n in self.signature.param_names]
        self._frozen = spmd_state.initial_frozen(self, model)  # requires_grad=False
        fresh = self.layout.zero_states(self.optimizer.initial_states_by_param(
            self.signature.param_names))
        self._states = [tvm.runtime.tensor(a, self._device) for a in fresh]
        # the buffers the step carries, world rank 0's values on every rank (as the pipeline
        # executor's)
        values = self._initial_buffers(model, self.signature.buffer_names,
                                       self.parallel.grad_world > 1)
        self._buffers = [tvm.runtime.tensor(v, self._device) for v in values.values()]
        self._low = self._low_copies()

    def _low_copies(self) -> List[Any]:
        """The 16-bit copies of the parameters the step reads and rewrites
        (signature.low_copies), cast from the parameters on the host: rounded to nearest
        even, as the step's own cast rounds (so a resumed run reads the bits an uninterrupted
        one would)."""
        return [tvm.runtime.tensor(self._params[i].numpy().astype(numpy_dtype(dtype)),
                                   self._device) for i, dtype in self.signature.low_copies]

    def fingerprint(self) -> Tuple[str, Dict[str, Any]]:
        """(digest, description): what every rank of a job must agree on before the first
        collective: the model (parameter names, shapes, dtypes; inputs), loss, optimizer,
        config and versions. The compiled step is a function of these."""
        signature = (held.full_signature(self) if self.ep_plan is not None
                     else self.signature)  # table-wise, the ranks hold other tables
        return agreement.fingerprint(dict(
            agreement.step_description(self), model=ckpt.model_description(signature),
            embedding_plan=self.ep_plan.describe() if self.ep_plan is not None else None))

    # ---- the loop -------------------------------------------------------------------------
    def _prepare(self, inputs: Sequence[Any], rows: int) -> Any:
        """(pieces, their compiled steps, this rank's ids verdict): local work first."""
        # every id a row of its table: this rank's verdict, raised on every rank together
        # with the rows' exchange (_rows_per_rank), before any table exchange
        check_ids = self.builder.check_ids
        bad_ids = check_ids.message(inputs, rows) if check_ids is not None else None
        pieces = batching.microbatches(rows, self.parallel.microbatches)
        variants = ([self._step_variant(r, "partial") for r in pieces[:-1]]
                    + [self._step_variant(pieces[-1], "final")] if len(pieces) > 1
                    else [self._step_variant(rows) if rows else None])
        return pieces, variants, bad_ids

    def _execute(self, inputs: Sequence[Any], y: Any, rows: int, prepared: Any) -> float:
        """The step's collectives and compiled functions on checked inputs; the loss.
        ``bad_ids``: this rank's ids check failed (the message), raised on every rank."""
        pieces, variants, bad_ids = prepared
        began = time.perf_counter()
        rows_per_rank = self._rows_per_rank(rows, bad_ids)  # a small collective under dp
        # the optimizer's own step count (Adam's bias correction): skipped steps do not count
        hypers, lr = self._next_hypers()
        if self._scaler is not None:
            hypers[GRAD_UNSCALE] = 1.0 / self._scaler.scale
        hyper_args = [tvm.runtime.tensor(np.array(hypers[h], dtype=self._hyper_dtype),
                                         self._device) for h in self.signature.hyper_names]
        before = self._traffic() if self.parallel.spmd else None
        accumulators, start = None, 0
        for m, (variant, piece) in enumerate(zip(variants, pieces)):
            args = spmd_state.step_inputs(self, variant, inputs, y, start, piece,
                                          rows_per_rank, m if len(pieces) > 1 else None)
            start += piece
            if variant.kind == "partial":  # gradients and loss added into the accumulators
                if accumulators is None:
                    accumulators = spmd_state.zero_accumulators(self)
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
                self._sent(a, b) for a, b in zip(after, before))
        n = len(self._params)
        # the step wrote the new values into the tensors it was given (UpdateInPlace) and
        # returns them; an output it could not prove safe to update in place is a new tensor
        self._params = [out[1 + i] for i in range(n)]
        self._states = [out[1 + n + i] for i in range(len(self._states))]
        first_buffer = 1 + n + len(self._states)
        self._buffers = [out[first_buffer + i] for i in range(len(self._buffers))]
        first_copy = first_buffer + len(self._buffers)
        self._low = [out[first_copy + i] for i in range(len(self._low))]
        self._buffers = self._rank0_buffers(self._buffers)
        loss = self._loss_of(out[0])
        self._last_lr = lr
        if self._scaler is not None:
            loss = self._scaled_step(loss)
        elif not math.isfinite(loss):
            self._nonfinite_step(loss)
        return self._finish_step(loss, began, self._flops_per_row * rows, sum(rows_per_rank))

    @property
    def update_guarded(self) -> bool:
        """Whether the compiled step skips its own update on a non-finite gradient: always
        without ZeRO; under ZeRO with nonfinite="skip" or loss scaling (ShardZeRO's guard,
        which waits for every gradient before any update)."""
        return not self.parallel.sharded_update or self.builder.guard_under_zero()

    def _in_model_order(self, trained: Any) -> Dict[str, Any]:
        """{name: value} of the trained parameters plus the frozen ones, ordered as the
        model's parameters (``named_parameters()`` for a PyTorch model)."""
        values = dict(trained)
        values.update(zip(self.signature.frozen_names, self._frozen))
        return {name: values[name] for name in self.model.param_names}

    def dropout_masks(self, step: int, rows: Optional[int] = None,
                      microbatch: Optional[int] = None) -> List[np.ndarray]:
        """The dropout masks of 1-based ``step`` on this rank, in execution order: 0 or
        1/(1-p) per element, drawn from a generator seeded by (seed, rank, step), so a run is
        reproducible and every rank drops different elements of its own rows. ``rows``: the
        step's batch size on this rank (default: the captured one); the masks have the shapes
        of the model at that size."""
        # tp ranks of one dp index compute the same replicated activations: the same masks
        rank = self.mesh.dp_rank if self.parallel.spmd else self.comm.rank
        seed = [self.seed, rank, int(step)] + ([] if microbatch is None else [int(microbatch)])
        rng = np.random.default_rng(seed)
        masks = []
        specs = (self.signature.dropout_specs if rows is None
                 else self._model_at(rows).dropout_specs)
        for shape, dtype, rate in specs:
            keep = rng.random(shape) >= rate
            masks.append((keep / (1.0 - rate)).astype(dtype))
        return masks

    def predict(self, x: Any) -> np.ndarray:
        """Forward pass with the current parameters (``_predict``); with context parallelism
        on whole sequences, each rank computing its tokens and the outputs gathered over the
        cp group (every rank of it must call it, with the same rows)."""
        split = self.builder.cp_split
        if split is None:
            return self._predict(x)
        inputs = list(x) if isinstance(x, (tuple, list)) else [x]
        local = np.ascontiguousarray(self._predict(split.inputs(inputs)))
        with self.comm.collective_work("predict", True):
            flat = collectives.allgather(local.reshape(-1), group=self.mesh.cp_group)
        pieces = np.split(flat, self.parallel.cp)
        return split.gather(local, pieces)

    def _predict(self, x: Any) -> np.ndarray:
        """Forward pass with the current parameters on any number of rows (runtime/predict.py:
        pieces of the captured batch size, one compiled forward per piece size); ``x`` one
        array or one per input; returns the outputs as one numpy array. Under ZeRO-3 the
        parameters are gathered first, and with sharded embedding tables the lookups exchange
        with the tables' holders, so every rank must call it (with the same rows)."""
        specs = self.signature.input_specs
        inputs, rows = predict_lib.check_rows(x, specs, self.batch_size)
        sharing = self.ep_plan is not None and self.parallel.grad_world > 1
        if sharing:  # before any other collective: the same rows everywhere, every id good
            spmd_state.agree_on_predict_rows(self, inputs, rows)
        with self.comm.collective_work("predict", self.parallel.spmd):
            params = list(self._in_model_order(zip(self.signature.param_names,
                                                    self._params)).values())
            if self.parallel.params_sharded:  # sharded between steps: gather them
                local = self._in_model_order(self._local_params())
                params = [tvm.runtime.tensor(local[n], self._device)
                          for n in self.model.param_names]

            def run_piece(pieces: Sequence[Any], rows: int) -> np.ndarray:
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
                    out = spmd_state.gather_classes(self, out)
                return out

            if sharing:
                return spmd_state.predict_shared(self, inputs, rows, run_piece)
            return predict_lib.in_pieces(inputs, specs, self.batch_size,
                                         self.model.respecialize is not None, run_piece)

    # ---- any batch size (training/batch_size.py) --------------------------------------------
    @property
    def compiled_batch_sizes(self) -> List[int]:
        """The batch sizes (rows on this rank) a training step has been compiled for."""
        return sorted(self._variants)

    def _model_at(self, rows: int) -> Any:
        """The model captured with ``rows`` rows (cached)."""
        rows = int(rows)
        if rows not in self._models:
            self._models[rows] = self.model.at_batch(rows)
        return self._models[rows]

    def _step_variant(self, rows: int, kind: Optional[str] = None) -> Any:
        """The compiled step for ``rows`` rows on this rank, compiled the first time a batch
        of that size comes (SPMDBuilder.compile_variant); it takes the same parameter, state
        and buffer tensors as every other size. ``kind``: "partial" / "final" for the
        microbatches of gradient accumulation."""
        key: Any = rows if kind is None else (rows, kind)
        variant = self._variants.get(key)
        if variant is not None:
            return variant
        _LOG.info("batch size %d on rank %d (the step was captured with %d): compiling a step "
                  "for this size; one compiled step per batch size, all sharing the "
                  "parameters and optimizer state", rows, self.comm.rank, self.batch_size)
        model = self._model_at(rows)
        signature, compiled = self.builder.compile_variant(self._built, model, rows, kind)
        vm = self.builder.vm(compiled)
        self._vms.append(vm)
        if self._profiling is not None:  # a size first seen while profiling is recorded too
            self._profiling.attach(vm)
        variant = batching.StepVariant(rows, model, signature, compiled, vm["train_step"], kind)
        self._variants[key] = variant
        return variant

    def _rows_per_rank(self, rows: int, bad_ids: Any = None) -> List[int]:
        """Every rank's rows in this step (one small allgather under data parallelism). Raises
        on every rank together when a rank has none, when synchronized batch norm would
        see different row counts (its statistics assume equal ones), and with sharded
        embedding tables when the counts differ (the exchanges' sizes are compiled in) or a
        rank's batch has an id outside its table (``bad_ids``, that rank's message)."""
        if self.parallel.grad_world > 1 and self.ep_plan is not None:
            rows_per_rank, bad = batches.allgather_rows_and_flags(self.dp_comm, rows,
                                                                  int(bad_ids is not None))
            spmd_state.check_sharded_tables_batch(rows_per_rank, bad, bad_ids)
        elif self.parallel.grad_world > 1:
            rows_per_rank = batches.allgather_rows(self.dp_comm, rows)
        else:
            rows_per_rank = [int(rows)]
        batches.check_rows_per_rank(rows_per_rank, self.dp_rank)
        if self.sync_batch_norm_world > 1 and len(set(rows_per_rank)) > 1:
            raise raised_on_every_rank(NotImplementedError(
                f"sync_batch_norm with different rows per rank ({rows_per_rank}) is not "
                "supported: the synchronized statistics assume every rank holds as many rows. "
                "Use raf_dist.data.shard(..., drop_last=True) or turn sync_batch_norm off"))
        return list(rows_per_rank)

    @property
    def _step_fn(self) -> Any:
        """The VM function of the step at the captured batch size (tests wrap it to inject
        failures inside a step)."""
        return self._variants[self.batch_size].step_fn

    @_step_fn.setter
    def _step_fn(self, function: Any) -> None:
        self._variants[self.batch_size].step_fn = function

    def _machines(self) -> List[Any]:
        return list(self._vms)

    def _planned_peak(self) -> int:
        """The planned temporaries of the step that runs: with microbatches the largest of
        the microbatch steps compiled so far (the captured whole-batch step until the first
        step compiles them), else the captured step's."""
        micro = [v.compiled.planned_peak_bytes  # type: ignore[attr-defined]
                 for v in self._variants.values()
                 if v.kind is not None]
        return int(max(micro) if micro else self.compiled.planned_peak_bytes)

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, np.ndarray]:
        """Full parameters by name (numpy arrays, true shapes). Under ZeRO-3 or tensor
        parallelism parameters are sharded, so this gathers them: every rank must call it."""
        local = {n: ckpt.host_array(v) for n, v in self._in_model_order(
            self._local_params()).items()}  # frozen ones too, in named_parameters() order
        if self.ep_plan is not None:  # the tables from the dp ranks (whole on every tp rank)
            local = {n: held.full_table(self.ep_plan, n, v, self.dp_group)
                     for n, v in local.items()}
        if self.parallel.tp == 1:
            return local
        return {n: held.full_parameter(self.tp_plan, n, v, self.mesh.tp_group, self.parallel.tp)
                for n, v in local.items()}

    def _local_params(self) -> Dict[str, np.ndarray]:
        """{name: array} of the trained parameters this rank computes with: whole (gathered
        over the dp ranks under ZeRO-3), this tp rank's pieces under tensor parallelism."""
        if self.layout.params_sharded:
            return {name: p.numpy() if self.layout.is_local(i) else
                    held.gather_shards(p, shape, self.parallel.grad_world, self.dp_group)
                    for i, (name, p, (shape, _)) in enumerate(
                        zip(self.signature.param_names, self._params,
                            self.signature.param_specs))}
        return {name: p.numpy() for name, p in zip(self.signature.param_names, self._params)}

    def buffers_dict(self) -> Dict[str, np.ndarray]:
        """Every buffer of the model by name, as ``module.named_buffers()`` lists them (numpy
        arrays): the running statistics the step carries (the same on every rank: rank 0's
        under data parallelism) and the constants folded into the IR."""
        return self._named_buffers({name: t.numpy() for name, t in
                                    zip(self.signature.buffer_names, self._buffers)}, self.model)

    def optimizer_state_dict(self) -> Dict[str, Dict[str, np.ndarray]]:
        """Optimizer state as {param name: {state name: array}}, full shapes. Under ZeRO the
        state is sharded, so this gathers it: every rank must call it."""
        states = held.full_optimizer_states(self.layout, self._states, self.dp_group,
                                            self.tp_plan, self.mesh.tp_group, self.parallel.tp)
        if self.ep_plan is None:
            return states
        return {p: {s: held.full_table(self.ep_plan, p, v, self.dp_group) for s, v in d.items()}
                for p, d in states.items()}

    # ---- checkpoints (the files and what each rank reads and writes: raf_dist.checkpoint) ----
    def save_checkpoint(self, path: Any, extra: Any = None, keep: int = 2) -> Any:
        """Write this rank's shards of every parameter and optimizer state under ``path``
        (see raf_dist.checkpoint for the layout); ``extra`` (JSON-serialisable, e.g. the data
        position) comes back from load_checkpoint. Atomic: ``path/latest`` moves to the new
        checkpoint only once every rank's file is on disk. Keeps the newest ``keep``
        checkpoints. Returns the checkpoint's directory. Every rank must call it."""
        if self.parallel.tp > 1 or self.ep_plan is not None:  # the full tensors, as any
            return self._save_full(path, extra, keep)  # layout writes them (full_train_state)
        return ckpt.save(self._train_state(), path, self._params,
                         self.layout.unpack_states([t.numpy() for t in self._states]), extra,
                         keep, buffers=self.buffers_dict())

    def _train_state(self) -> Any:
        """What a checkpoint of this executor's own layout writes and reads."""
        layout = self.parallel
        return ckpt.TrainState.of(self.comm, layout.grad_world, layout.zero_level,
                                  self.signature, self.step_count, self.seed, self.config,
                                  self.loss, self.optimizer, self.model, self._frozen,
                                  shared=layout.data_parallel or layout.local,
                                  loop=self.loop_state())

    def load_checkpoint(self, path: Any) -> Any:
        """Load the newest checkpoint under ``path`` (or the checkpoint directory ``path``),
        whatever world size and ZeRO level wrote it: each rank reads the element ranges it
        now holds. Returns the ``extra`` given to save_checkpoint. Every file's size, the
        sha256 of each file a rank reads, and the model's names, shapes and dtypes are checked
        first, on every rank, and any problem raises the same CheckpointError everywhere
        before any data moves; nothing on disk is modified. Every rank must call it."""
        if self.parallel.tp > 1 or self.ep_plan is not None:  # full tensors in
            full, states, buffers, frozen, meta = self._load_full(path)  # (full_train_state),
            params = [full[n] for n in self.signature.param_names]  # this rank's pieces kept
            params, states, frozen = spmd_state.pieces(self, params, states, frozen)
        else:
            params, states, buffers, frozen, meta = ckpt.load(self._train_state(), path)
        self._frozen = [tvm.runtime.tensor(frozen[n], self._device) if n in frozen else t
                        for n, t in zip(self.signature.frozen_names, self._frozen)]
        self._params = [tvm.runtime.tensor(p, self._device) for p in params]
        self._buffers = [tvm.runtime.tensor(buffers[n], self._device)
                         for n in self.signature.buffer_names]
        self._states = [tvm.runtime.tensor(a, self._device)
                        for a in self.layout.pack_states(states)]
        self._low = self._low_copies()
        return self._loaded(meta)

    def _stats_entries(self) -> Dict[str, Any]:
        """stats(): what this rank holds between steps (parameters, optimizer state), the
        gradient bytes that outlive their bucket's collective, the step's planned temporaries
        and the bus bytes it sent in the last step by collective kind."""
        return {
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
            "comm_bytes_by_axis": dict(self._comm_by_axis)}
