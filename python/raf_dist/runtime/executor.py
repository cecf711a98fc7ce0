"""The executor interface the Trainer forwards (``Executor``) and the frame both executors
share (``ExecutorFrame``, DESIGN.md section 2, runtime/).

The frame holds what a step is whatever runs it: the run's state read once from the plan
(``self.parallel`` is the run's ``ParallelLayout``: nobody copies its fields), the input
checks, the step and profile wrappers (the flight recorder's activity around every
collective), the non-finite policy, the loop's scalars and metrics (runtime/loop.py), buffers
kept at dp rank 0's, traffic counting, ``stats()``'s shared entries and checkpoint
save / load through the full train state. An executor adds what differs (its build, in
runtime/spmd_build.py or runtime/pipeline_build.py, and how a checked step runs) through the
hooks ``_prepare`` (local work before any collective), ``_execute`` (the step),
``_machines`` (the VMs profile instruments), ``_planned_peak`` and ``_stats_entries``.
"""
import logging
import math
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import tvm

from .. import checkpoint as ckpt
from .. import device as device_lib
from .. import process_memory, profiler
from ..distributed import collectives
from ..distributed.communicator import raised_on_every_rank
from ..training import batch_size as batching
from ..training.loss import check_targets
from . import mixed_precision
from . import state as held
from .loop import LoopScalars
from .loss_scale import LossScaler
from .plan import RunPlan
from .tensors import check_array

_LOG = logging.getLogger("raf_dist")


class Executor(Protocol):
    """What raf_dist.Trainer forwards: every executor serves all of it (or refuses a call
    with a clear error)."""

    def step(self, x: Any, y: np.ndarray) -> float: ...
    def predict(self, x: Any) -> np.ndarray: ...
    def metrics(self) -> Dict[str, Any]: ...
    def profile(self, steps: int, path: Any) -> str: ...
    def dropout_masks(self, step: int, rows: Optional[int] = None,
                      microbatch: Optional[int] = None) -> List[np.ndarray]: ...
    def state_dict(self) -> Dict[str, np.ndarray]: ...
    def optimizer_state_dict(self) -> Dict[str, Dict[str, np.ndarray]]: ...
    def buffers_dict(self) -> Dict[str, np.ndarray]: ...
    def stats(self) -> Dict[str, Any]: ...
    def save_checkpoint(self, path: Any, extra: Any = None, keep: int = 2) -> Any: ...
    def load_checkpoint(self, path: Any) -> Any: ...
    def fingerprint(self) -> Tuple[str, Dict[str, Any]]: ...

    @property
    def compiled_batch_sizes(self) -> List[int]: ...
    @property
    def num_grad_buckets(self) -> int: ...
    @property
    def update_guarded(self) -> bool: ...
    @property
    def last_lr(self) -> float: ...
    @property
    def last_grad_norm(self) -> Optional[float]: ...
    @property
    def loss_scale(self) -> Optional[float]: ...
    @property
    def step_count(self) -> int: ...
    @step_count.setter
    def step_count(self, value: int) -> None: ...


class ExecutorFrame(LoopScalars):
    """The shared frame (module docstring). Subclasses set ``signature``, ``batch_size``,
    ``grad_buckets``, ``_classes``, ``_metrics`` and define the hooks."""

    signature: Any
    builder: Any  # the executor's step builder (spmd_build / pipeline_build)
    batch_size: int
    grad_buckets: List[Any]
    _classes: Optional[int]

    def __init__(self, model: Any, loss: str, optimizer: Any, device: str, plan: RunPlan,
                 mesh: Any, comm: Any, *, cache_dir: Any, seed: int, nonfinite: str,
                 precision: str, grad_reduce_dtype: str, lr_schedule: Any,
                 max_grad_norm: Optional[float]) -> None:
        """The run's state both executors hold, read once from ``plan`` (the front checked
        the arguments and the ranks agreed)."""
        self.run_plan, self.config, self.comm, self.mesh = plan, plan.config, comm, mesh
        self.parallel = plan.layout
        # the gradient group: dp, or dp x cp with context parallelism (ParallelLayout)
        self.dp_group, self.dp_comm = mesh.grad_group, mesh.grad_comm
        self.dp_rank = self.parallel.grad_rank if self.parallel.grad_world > 1 else 0
        self.model, self.full_model = model, model
        self.loss, self.optimizer, self.device = loss, optimizer, device
        self.nonfinite, self.seed, self._cache_dir = nonfinite, int(seed), cache_dir
        self.precision, self.grad_reduce_dtype = precision, grad_reduce_dtype
        self.lr_schedule, self._last_lr = lr_schedule, None
        self.max_grad_norm, self._last_grad_norm = max_grad_norm, None
        # float16's range needs the loss scaled (runtime/loss_scale.py); bfloat16's does not
        self._scaler = LossScaler() if precision == "fp16" else None
        self.compute_dtype = mixed_precision.compute_dtype(precision, device)
        self.bucket_bytes = plan.bucket_bytes
        # synchronized batch norm: statistics of the global batch (passes/batch_norm.py)
        self.sync_batch_norm_world = plan.sync_batch_norm_world
        self.skipped_steps = 0  # steps whose update nonfinite="skip" left out
        self.step_count = 0
        self._comm_last_step: Dict[str, int] = {}
        self._comm_by_axis: Dict[str, int] = {}
        self._profiling: Any = None  # a profiler.StepProfiler while profile records
        # collective only when every rank builds this Trainer
        self._device = device_lib.select(device, comm, collective=self.parallel.spmd)
        self._target = device_lib.target_for(self._device)

    # ---- the hooks ---------------------------------------------------------------------------
    def _prepare(self, inputs: Sequence[Any], rows: int) -> Any:
        """Local work on checked inputs before any collective (compiling new sizes)."""
        raise NotImplementedError

    def _execute(self, inputs: Sequence[Any], y: Any, rows: int, prepared: Any) -> float:
        """The step's collectives and compiled functions; the loss."""
        raise NotImplementedError

    def _machines(self) -> List[Any]:
        """Every relax.VirtualMachine a step runs (profile instruments them)."""
        raise NotImplementedError

    def _planned_peak(self) -> int:
        """The planned temporaries of what the step runs."""
        raise NotImplementedError

    def _stats_entries(self) -> Dict[str, Any]:
        """stats()'s entries of this executor (held bytes, planned peak, traffic, ...)."""
        raise NotImplementedError

    # ---- the loop ----------------------------------------------------------------------------
    def step(self, x: Any, y: np.ndarray) -> float:
        """One optimizer step on this rank's slice of the global batch; returns the mean loss
        over the global batch on every rank."""
        # stats()'s runtime_bytes: what the first step adds to the host's memory beyond its
        # planned temporaries (on a GPU those are the device's)
        with process_memory.first_run(
                self, lambda: 0 if device_lib.is_gpu(self._device) else self._planned_peak()):
            if self._profiling is not None and self._profiling.active:
                return float(self._profiling.step(self._run_step, self.step_count + 1, x, y))
            return self._run_step(x, y)

    def profile(self, steps: int, path: Any) -> str:
        """Record the next ``steps`` calls to ``step`` — every kernel, BLAS call, collective
        start / wait (with bytes), the pipeline's F / B, and the step itself — and write them
        as a Chrome trace to ``path/trace-rank{R}.json`` when the last one ends (see
        raf_dist.profiler). Returns that file's path."""
        if self._profiling is not None:
            self._profiling.finish()  # a trace already being recorded is written as it is
        self._profiling = profiler.StepProfiler(self._machines(), self.comm.rank, steps, path)
        return str(self._profiling.path)

    def _run_step(self, x: Any, y: Any) -> float:
        """``step`` without the profiler: the inputs checked against the captured signature
        (any leading batch dimension, training/batch_size.py) before any work."""
        inputs = x if isinstance(x, (tuple, list)) else (x,)
        split = self.builder.cp_split
        if split is not None:  # context parallelism: this rank's tokens of whole sequences
            rows = int(np.shape(inputs[0])[0]) if np.ndim(inputs[0]) else 0
            inputs, y = split.inputs(inputs), split.target(y, rows)
        signature = self.signature
        if len(inputs) != signature.num_inputs:
            raise ValueError(f"step() got {len(inputs)} inputs; the model was captured with "
                             f"{signature.num_inputs}")
        rows = batching.leading_rows(inputs, signature.input_specs, self.batch_size)
        for i, (a, spec) in enumerate(zip(inputs, signature.input_specs)):
            check_array(a, batching.batched_spec(spec, rows, self.batch_size), f"input {i}")
        check_array(y, batching.batched_target_spec(signature.target_spec, rows,
                                                     self.batch_size), "target")
        if self._classes is not None:  # before any collective: the message names the value
            check_targets(y, self._classes)
        prepared = self._prepare(inputs, rows)  # local work, before collectives
        # the step running and the last one completed: a failure message is unambiguous
        # (checkpoints are named by the last completed step); from its first collective on,
        # an exception on this rank ends the job (Communicator.collective_work)
        with self.comm.collective_work(
                f"step {self.step_count + 1} (last completed: {self.step_count})",
                self.parallel.spmd):
            loss = self._execute(inputs, y, rows, prepared)
        self.comm.activity = f"work between steps (last completed: {self.step_count})"
        return loss

    def _finish_step(self, loss: float, began: float, flops: float, rows: int) -> float:
        """The step counted and its metrics recorded; returns ``loss``."""
        self.step_count += 1
        self._metrics.record(self.step_count, loss, self._last_lr, time.perf_counter() - began,
                             flops, rows, grad_norm=self._last_grad_norm,
                             loss_scale=self.loss_scale)
        return loss

    @property
    def num_grad_buckets(self) -> int:
        """Collectives per step for gradients (0 without data parallelism)."""
        return len(self.grad_buckets)

    # ---- traffic -------------------------------------------------------------------------
    def _traffic(self) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(bus bytes by collective kind, by mesh axis) so far, as comm_counters gives them."""
        total = collectives.comm_counters()
        if self.parallel.tp == 1 and self.parallel.cp == 1:
            return total, {}
        axes = {}
        for axis, group in (("tp", self.mesh.tp_group), ("dp", self.mesh.dp_group),
                            ("cp", self.mesh.cp_group)):
            if group == -1 or (axis == "tp" and self.parallel.tp == 1):
                continue
            counters = collectives.comm_counters(group=group)
            axes[axis] = {"calls": sum(c["calls"] for c in counters.values()),
                          "bus_bytes": sum(c["bus_bytes"] for c in counters.values())}
        return total, axes

    @staticmethod
    def _sent(after: Dict[str, Any], before: Dict[str, Any]) -> Dict[str, int]:
        """{kind: bus bytes} of the counters that were called between ``before`` and
        ``after``."""
        return {k: after[k]["bus_bytes"] - before.get(k, {}).get("bus_bytes", 0)
                for k in after if after[k]["calls"] > before.get(k, {}).get("calls", 0)}

    # ---- non-finite losses and gradients (training/nonfinite.py) ---------------------------
    def _nonfinite_step(self, loss: float) -> None:
        """The step's global loss is NaN/inf (the step makes it NaN when a gradient is not
        finite): every rank takes the same branch. With the update guarded, nonfinite="skip"
        counts the skip and warns, "raise" raises; unguarded (ZeRO overlapped) the update ran:
        the step is counted and the error says to restore."""
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

    def _scaled_step(self, scaled_loss: float) -> float:
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

    @property
    def update_guarded(self) -> bool:
        raise NotImplementedError

    # ---- buffers -------------------------------------------------------------------------
    def _initial_buffers(self, model: Any, names: Sequence[str],
                         everywhere: bool) -> Dict[str, np.ndarray]:
        """{name: initial value} of ``names``; ``everywhere``: world rank 0's values on every
        rank (a broadcast per buffer, every rank taking part)."""
        values = {}
        for name in names:
            value = np.array(model.init_buffers[name], order="C")  # 0-d stays 0-d
            if everywhere:
                collectives.broadcast(value.reshape(-1), root=0)  # fills value
            values[name] = value
        return values

    def _rank0_buffers(self, tensors: Sequence[Any]) -> List[Any]:
        """DDP's broadcast_buffers over the dp group: every rank normalized with its own batch
        statistics, dp rank 0's running statistics are kept (with sync_batch_norm they are
        equal already; the broadcast keeps them bit-identical)."""
        if self.parallel.grad_world == 1 or not tensors:
            return list(tensors)
        out = []
        for tensor in tensors:
            host = np.array(tensor.numpy(), order="C")
            collectives.broadcast(host.reshape(-1), root=0, group=self.dp_group)  # fills host
            out.append(tvm.runtime.tensor(host, self._device))
        return out

    @staticmethod
    def _named_buffers(carried: Dict[str, np.ndarray], model: Any) -> Dict[str, np.ndarray]:
        """Every buffer of ``model`` by name, as ``module.named_buffers()`` lists them: the
        ``carried`` running statistics and the constants folded into the IR."""
        order = model.buffer_order or list(carried)
        return {name: carried[name] if name in carried else model.constant_buffers[name]
                for name in order}

    # ---- stats and checkpoints -----------------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        """What this rank holds between steps (parameters, optimizer state), the gradient
        bytes that outlive their collective, the planned temporaries, the bus bytes of the
        last step by collective kind, and the executor's own entries (``_stats_entries``)."""
        return dict(process_memory.with_total({
            **self._stats_entries(),
            **device_lib.memory_stats(self._device),  # GPU: used / total (pynvml)
            **process_memory.overheads(),  # compiled code, libraries loaded
        }))

    def _save_full(self, path: Any, extra: Any, keep: int) -> Any:
        """A checkpoint of the full tensors, written as any layout writes them
        (full_train_state): every rank gathers each full tensor and writes its range."""
        full = self.state_dict()
        states = {(p, s): v for p, d in self.optimizer_state_dict().items()
                  for s, v in d.items()}
        view = held.full_train_state(self, full)
        return ckpt.save(view, path, [full[n] for n in view.signature.param_names], states,
                         extra, keep, buffers=self.buffers_dict())

    def _load_full(self, path: Any) -> Tuple[Dict[str, Any], Dict[Any, Any], Dict[str, Any],
                                             Dict[str, Any], Dict[str, Any]]:
        """({name: full parameter} (frozen ones included), {(param, state): full array},
        buffers, frozen, meta) of a checkpoint of any layout."""
        view = held.full_train_state(self, {})
        params, states, buffers, frozen, meta = ckpt.load(view, path)
        full = dict(zip(view.signature.param_names, params))
        return full, states, buffers, frozen, meta

    def _loaded(self, meta: Dict[str, Any]) -> Any:
        """The loop's counters from a loaded checkpoint's ``meta``; its ``extra``."""
        self.step_count, self.seed = int(meta["step"]), int(meta["seed"])
        self.load_loop_state(meta.get("loop", {}))
        return meta.get("extra")

    def state_dict(self) -> Dict[str, np.ndarray]:
        raise NotImplementedError

    def optimizer_state_dict(self) -> Dict[str, Dict[str, np.ndarray]]:
        raise NotImplementedError

    def buffers_dict(self) -> Dict[str, np.ndarray]:
        raise NotImplementedError
