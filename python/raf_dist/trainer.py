"""Trainer: the loop's one entry point (DESIGN.md section 1), and only its contract surface.

It checks its arguments, reads ``dist.get_config()`` once into a plan (``runtime.plan``),
meets the other ranks (``runtime.agreement``), builds the mesh and picks an executor by
composition: ``runtime.spmd_executor.SPMDExecutor`` (one compiled step: single process,
data parallel, ZeRO, tensor parallel) or ``runtime.pipeline_executor.PipelineExecutor``
(stages on the pp axis), both ``runtime.executor.Executor``s. Every public method is the
executor's; each executor serves the whole surface or refuses a call with a clear error.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import device as device_lib
from . import env, process_memory
from .distributed import get_communicator, get_config
from .model import Model
from .optim import Optimizer
from .runtime import set_num_threads, threads_per_rank
from .runtime.agreement import agree
from .runtime.executor import Executor
from .runtime.mixed_precision import GRAD_REDUCE_DTYPES, PRECISIONS
from .distributed.mesh import mesh_for
from .runtime.pipeline_executor import PipelineExecutor
from .runtime.plan import plan_run
from .runtime.spmd_executor import SPMDExecutor
from .training import LOSSES

NONFINITE_MODES = ("raise", "skip")

Batch = Union[np.ndarray, Sequence[np.ndarray]]


class Trainer:
    """Train ``model`` (a :class:`raf_dist.model.Model`) with ``loss`` and ``optimizer``.

    ``step(x, y)`` takes this rank's slice of the global batch (numpy arrays) and returns the
    mean loss as a float; ``state_dict()`` returns the full parameters as numpy arrays.
    """

    def __init__(self, model: Model, loss: str = "cross_entropy",
                 optimizer: Optional[Optimizer] = None, device: str = "cpu",
                 cache_dir: Optional[str] = None, seed: int = 0, nonfinite: str = "raise",
                 tensor_parallel_plan: Optional[Dict[str, str]] = None,
                 local: bool = False, precision: str = "fp32",
                 grad_reduce_dtype: str = "float32",
                 lr_schedule: Optional[Callable[[int], float]] = None,
                 log_every: int = 0, max_grad_norm: Optional[float] = None,
                 embedding_plan: Optional[Dict[str, int]] = None) -> None:
        """``nonfinite``: what ``step`` does when the loss or a gradient is NaN or infinite:
        ``"raise"`` (default) raises FloatingPointError naming the step, ``"skip"`` returns the
        NaN loss and logs a warning on the ``raf_dist`` logger; either way the update is not
        applied, on every rank together (parameters and optimizer state stay as they were;
        training/nonfinite.py). Under ZeRO, with ``"skip"`` the updates wait until every
        rank's gradients are known to be finite (they no longer overlap backward); with
        ``"raise"`` each bucket is updated as soon as it is reduced (overlapped) and the error
        comes after the update: restore the last checkpoint.

        ``tensor_parallel_plan`` (with ``tensor_parallel_size`` > 1): {parameter or module
        name pattern: "colwise" | "rowwise" | "replicate"} instead of the plan the
        tensor-parallel pass finds itself (``raf_dist.explain_parallel_plan`` prints either).

        ``local=True``: a Trainer of this rank alone (a reference or evaluation model built on
        some ranks only): it takes part in no agreement and no collective, and refuses any
        parallelism in the config. Otherwise, in a world of several ranks, every rank's
        Trainer meets the others' at construction (``runtime.agreement``), so ranks that
        disagree on the parallelism stop at once, naming the field, instead of waiting in a
        collective.

        ``precision``: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``: mixed precision
        (passes/auto_cast.py): matmuls, convolutions and the elementwise work between them
        compute in the low dtype, softmax, normalisation statistics and the loss in float32;
        parameters and optimizer states stay float32 (``state_dict()`` is float32).
        ``grad_reduce_dtype``: the dtype gradients travel in between data-parallel ranks
        (``"float32"`` or ``"bfloat16"``: half the bytes). ``"fp16"`` scales the loss
        dynamically as ``torch.amp.GradScaler`` (runtime/loss_scale.py): a step whose
        gradients overflow is skipped on every rank (its loss returned as NaN) and the scale
        halves; ``loss_scale`` is the current scale.

        ``lr_schedule``: ``f(k)`` multiplies the learning rate of the k-th update (k = 0
        first), as ``torch.optim.lr_scheduler.LambdaLR`` stepped after each update; skipped
        steps do not advance k, and a resumed checkpoint continues it. Ready-made ones in
        ``raf_dist.optim.schedules``; ``last_lr`` is the last step's learning rate.

        ``log_every``: log ``metrics()`` on the ``raf_dist`` logger (INFO) every that many
        steps (0: never).

        ``max_grad_norm``: clip the gradients by their global L2 norm as
        ``torch.nn.utils.clip_grad_norm_`` on one process on the global batch, whatever the
        mesh (every element counted once: passes/clipping.py); ``last_grad_norm`` is the norm
        before clipping, the same float on every rank.

        ``embedding_plan`` (with ``embedding_parallel="table"``): {table name or pattern
        (module "tables.3" or parameter "tables.3.weight"): dp rank} places those tables; the
        others are balanced by bytes around them (passes/embedding_parallel.py). A name that
        is no table of the model, or a rank outside the dp group, is refused here on every
        rank."""
        check_arguments(model, loss, optimizer, device, nonfinite)
        check_precision(precision, grad_reduce_dtype)
        if lr_schedule is not None and not callable(lr_schedule):
            raise TypeError(f"lr_schedule must be a callable k -> multiplier (see "
                            f"raf_dist.optim.schedules), got {lr_schedule!r}")
        check_max_grad_norm(max_grad_norm)
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0:
            raise ValueError(f"log_every must be an int >= 0 (0: no logging), got "
                             f"{log_every!r}")
        config = get_config()
        comm = get_communicator()
        # the config, read once into its ParallelLayout; every refusal of a combination
        # (layout.refusals.REFUSALS) raised here, on the config, model and optimizer alone
        plan = plan_run(config, comm.size, comm.rank, local, model, optimizer)
        if comm.size > 1 and not local:  # before any other collective
            agree(comm, plan, model, loss, optimizer, device, embedding_plan)
        mesh = mesh_for(plan.layout)
        # a 16-bit step on the host multiplies in PyTorch's oneDNN, on its own pool
        second_pool = (PRECISIONS[precision] is not None
                       and device_lib.parse(device)[0] != "cuda")
        set_num_threads(threads_per_rank(comm.local_size), second_pool)
        executor = PipelineExecutor if plan.layout.pipelined else SPMDExecutor
        # pipelining refuses sharded tables (layout.refusals.REFUSALS)
        extra = {} if plan.layout.pipelined else {"embedding_plan": embedding_plan}
        self.executor: Executor = executor(
            model, loss, optimizer, device, plan, mesh, comm, cache_dir=cache_dir, seed=seed,
            nonfinite=nonfinite, tensor_parallel_plan=tensor_parallel_plan,
            precision=precision, grad_reduce_dtype=grad_reduce_dtype,
            lr_schedule=lr_schedule, log_every=log_every, max_grad_norm=max_grad_norm,
            **extra)
        # what construction freed and the compiler's code (until it compiles again), as the
        # executors drop them before making their states
        process_memory.after_compile()
        if env.profile_dir() is not None:
            self.profile(env.profile_steps(), env.profile_dir())

    # ---- the loop -------------------------------------------------------------------------
    def step(self, x: Batch, y: np.ndarray) -> float:
        """One optimizer step on this rank's slice of the global batch; returns the mean loss
        over the global batch on every rank. Any number of rows (each batch size compiles its
        own step the first time it comes)."""
        return self.executor.step(x, y)

    def predict(self, x: Batch) -> np.ndarray:
        """The model's output on any number of rows (evaluation: running statistics, no
        dropout), as one numpy array; ``x`` one array, or a tuple of one per input (as
        ``step`` takes them). Where parameters are sharded this gathers them, and with sharded
        embedding tables each rank computes a share of the rows: every rank must call it,
        with the same rows."""
        return self.executor.predict(x)

    def metrics(self) -> Dict[str, Any]:
        """The last step's measurements ({} before the first): ``loss``, ``lr``,
        ``grad_norm`` (None without clipping), ``step_time_s``, ``rows_per_s`` and
        ``tokens_per_s`` (global; tokens when the first input is (rows, seq) integer ids),
        ``flops_per_step`` and ``flops_per_s`` (this rank's, counted from the IR it runs),
        ``mfu`` (against this machine's measured float32 GEMM rate), ``loss_scale``. See
        raf_dist.runtime.metrics."""
        return self.executor.metrics()

    def profile(self, steps: int, path: Any) -> str:
        """Record the next ``steps`` calls to ``step`` — every kernel, BLAS call, collective
        start / wait (with bytes), the pipeline's F / B, and the step itself — and write them
        as a Chrome trace to ``path/trace-rank{R}.json`` when the last one ends (see
        raf_dist.profiler). Returns that file's path. Open it in Perfetto, or merge the ranks'
        files with ``python -m raf_dist.tools.timeline path``."""
        return self.executor.profile(steps, path)

    def dropout_masks(self, step: int, rows: Optional[int] = None,
                      microbatch: Optional[int] = None) -> List[np.ndarray]:
        """The dropout masks of 1-based ``step`` on this rank, in execution order: 0 or
        1/(1-p) per element, drawn from a generator seeded by (seed, rank, step)."""
        return self.executor.dropout_masks(step, rows, microbatch)

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, np.ndarray]:
        """Every full parameter by name (numpy arrays, true shapes, ``named_parameters()``
        order), on every rank whatever the mesh: every rank must call it."""
        return self.executor.state_dict()

    def optimizer_state_dict(self) -> Dict[str, Dict[str, np.ndarray]]:
        """Optimizer state as {param name: {state name: full array}}: every rank calls it."""
        return self.executor.optimizer_state_dict()

    def buffers_dict(self) -> Dict[str, np.ndarray]:
        """Every buffer of the model by name, as ``module.named_buffers()`` lists them."""
        return self.executor.buffers_dict()

    def stats(self) -> Dict[str, Any]:
        """What this rank holds between steps (``param_bytes``, ``grad_bytes``,
        ``optimizer_state_bytes``), the step's ``planned_peak_bytes``, the process's
        ``compiled_code_bytes``, ``library_bytes`` (TVM, torch.export and MPI as loading them
        grew the RSS, and the pages of libraries loaded earlier that ran since),
        ``runtime_bytes`` (the first step's thread stacks and kernel workspaces) and
        ``allocator_free_bytes`` (the C allocator's free bytes held), all measured by
        raf_dist.process_memory; their sum ``total_bytes`` (the predicted RSS growth since
        ``import raf_dist``), the bus bytes it sent in the last step by
        collective kind (``comm_bytes_last_step``) and what it holds between steps by dtype
        (``held_bytes_by_dtype``: under mixed precision, float32 masters and states)."""
        return self.executor.stats()

    def memory_report(self, file: Any = None) -> str:
        """stats()'s memory as a table, beside the process's measured RSS growth since
        ``import raf_dist``; printed to ``file`` (default stdout) and returned."""
        text = process_memory.report(self.stats(), process_memory.rss_bytes(),
                                     process_memory.baseline_rss())
        print(text, file=file)
        return text

    def save_checkpoint(self, path: Any, extra: Any = None, keep: int = 2) -> Any:
        """Write this rank's share of every parameter, optimizer state and buffer under
        ``path`` (see raf_dist.checkpoint); ``extra`` (JSON-serialisable) comes back from
        load_checkpoint. Atomic; keeps the newest ``keep``. Every rank must call it."""
        return self.executor.save_checkpoint(path, extra, keep)

    def load_checkpoint(self, path: Any) -> Any:
        """Load the newest checkpoint under ``path`` (or that checkpoint directory), whatever
        layout wrote it; returns its ``extra``. Every rank must call it."""
        return self.executor.load_checkpoint(path)

    def fingerprint(self) -> Tuple[str, Dict[str, Any]]:
        """(digest, description) of what every rank of the job agreed on."""
        return self.executor.fingerprint()

    @property
    def compiled_batch_sizes(self) -> List[int]:
        """The batch sizes (rows on this rank) a training step has been compiled for."""
        return self.executor.compiled_batch_sizes

    @property
    def num_grad_buckets(self) -> int:
        """Collectives per step for gradients (0 without data parallelism)."""
        return self.executor.num_grad_buckets

    @property
    def update_guarded(self) -> bool:
        """Whether the step skips its own update on a non-finite gradient."""
        return self.executor.update_guarded

    @property
    def last_lr(self) -> float:
        """The learning rate the last step used (``lr_schedule``'s; before the first step,
        the one it will use)."""
        return self.executor.last_lr

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The last step's global gradient norm before clipping (with ``max_grad_norm``;
        None before the first step or without clipping)."""
        return self.executor.last_grad_norm

    @property
    def loss_scale(self) -> Optional[float]:
        """The dynamic loss scale under ``precision="fp16"`` (None otherwise)."""
        return self.executor.loss_scale

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (those nonfinite="skip" left out included)."""
        return self.executor.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.executor.step_count = int(value)

    def __getattr__(self, name: str) -> Any:
        """The executor's other public attributes, read-only (``signature``, ``mesh``,
        ``tp_plan``, ``skipped_steps``, ``seed``; the pipeline's ``plan``, ``num_stages``,
        ``last_timeline``, ...). Private names are the executor's own: reach them through
        ``trainer.executor``."""
        if name.startswith("_") or name == "executor":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.executor, name)


def check_max_grad_norm(max_grad_norm: Any) -> None:
    """``max_grad_norm``: None or a finite number > 0."""
    if max_grad_norm is None:
        return
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not (
            0 < max_grad_norm < float("inf")):
        raise ValueError(f"max_grad_norm must be None or a finite number > 0 (1.0 is the usual "
                         f"value for language models), got {max_grad_norm!r}")


def check_precision(precision: Any, grad_reduce_dtype: Any) -> None:
    """``precision`` and ``grad_reduce_dtype`` checked before anything starts."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    if grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise ValueError(f"grad_reduce_dtype must be one of {GRAD_REDUCE_DTYPES}, got "
                         f"{grad_reduce_dtype!r}")


def check_arguments(model: Any, loss: Any, optimizer: Any, device: Any, nonfinite: Any) -> None:
    """The constructor's arguments, checked before anything starts."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; expected one of {LOSSES}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    if not isinstance(model, Model):
        raise TypeError(f"Trainer takes a captured model (raf_dist.model.Model), got "
                        f"{type(model).__module__}.{type(model).__name__}: capture a PyTorch "
                        "module with raf_dist.frontend.from_pytorch(module, example_inputs) "
                        "or a raf_dist.nn module with raf_dist.frontend.from_relax_nn")
    if not isinstance(optimizer, Optimizer):
        raise TypeError("optimizer must be a raf_dist.optim optimizer (SGD, Adagrad, "
                        "RowWiseAdagrad, Adam, AdamW), "
                        f"got {optimizer!r}")
    device_lib.parse(device)  # a bad device string fails before anything starts
    # parameter groups: every group valid and every pattern matching a trained parameter of
    # the whole model (a pipeline rank or tp piece sees only some of them)
    optimizer.groups()
    frozen = set(getattr(model, "frozen_params", ()))
    optimizer.assign([n for n in model.param_names if n not in frozen])
