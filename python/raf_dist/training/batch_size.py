"""Any batch size at step time: what the Trainer needs to run a batch whose leading (batch)
dimension differs from the captured one, and to weight uneven data-parallel batches.

The captured step is static. A batch of another size gets a step specialised for it: the
frontend captures the model again at that size (``Model.at_batch``), ``build_train_step`` and
``compile_step`` run as for the captured size, and the Trainer keeps one compiled step per
batch size seen, all sharing the same parameter, optimizer-state and buffer tensors (their
shapes do not depend on the batch; ``check_same_state`` holds that). Why not one symbolic
step: docs/design-notes.md ("Any batch size").

Under data parallelism each rank may hold a different number of rows (the uneven last batch
of ``data.shard(..., drop_last=False)``). Every rank's step multiplies its mean loss by
``loss_weight = local_rows * N / global_rows`` before autodiff; the step's averaging
collectives (divide by N) then give the mean loss and the mean gradient over all rows of the
global batch, i.e. one process on that batch.
"""
import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

#: (shape, dtype) of an input or target as the step was captured
Spec = Tuple[Sequence[int], str]


@dataclasses.dataclass
class StepVariant:
    """The compiled step for one batch size (rows per rank)."""

    rows: int
    model: object  # the Model captured at this size
    signature: object  # its TrainStepSignature
    compiled: object  # its CompiledStep
    step_fn: object  # the VM's train_step
    # None: a whole step; "partial" / "final": a microbatch's (accumulation)
    kind: Optional[str] = None


def is_batched(spec: Spec, captured_rows: int) -> bool:
    """Whether an input (or target) of captured ``spec`` (shape, dtype) leads with the batch
    of ``captured_rows`` rows (and so takes any number of rows)."""
    return bool(len(spec[0])) and int(spec[0][0]) == captured_rows


def batched_spec(spec: Spec, rows: int, captured_rows: int) -> Tuple[Tuple[int, ...], str]:
    """``spec`` (shape, dtype) with its leading dimension ``rows`` when that dimension is the
    captured batch (a batched input or target), else unchanged."""
    shape, dtype = spec
    shape = tuple(int(d) for d in shape)
    if is_batched(spec, captured_rows):
        shape = (int(rows),) + shape[1:]
    return shape, dtype


def target_rows_per_row(target_spec: Spec, captured_rows: int) -> Optional[int]:
    """How many rows of the target each input row carries: 1 for a target of the batch's
    rows, T for a flattened one (a language model's ``logits.reshape(B * T, V)`` against
    targets of shape ``(B * T,)``); None when the target's leading dimension is not a
    multiple of the captured rows (it does not follow the batch: a microbatch cannot carry a
    share of it)."""
    shape = tuple(int(d) for d in target_spec[0])
    if not len(shape) or not captured_rows or shape[0] % int(captured_rows):
        return None
    return shape[0] // int(captured_rows)


def batched_target_spec(target_spec: Spec, rows: int, captured_rows: int
                        ) -> Tuple[Tuple[int, ...], str]:
    """The target's (shape, dtype) for a batch of ``rows`` input rows: its leading dimension
    scaled with the batch (``target_rows_per_row`` target rows per input row), else
    unchanged."""
    shape, dtype = target_spec
    shape = tuple(int(d) for d in shape)
    per_row = target_rows_per_row(target_spec, captured_rows)
    if per_row is None:
        return shape, dtype
    return (int(rows) * per_row,) + shape[1:], dtype


def target_piece(target: Any, start: int, rows: int, per_row: int) -> np.ndarray:
    """The target rows of input rows [start, start + rows) (``per_row`` target rows each)."""
    return np.asarray(target)[start * per_row:(start + rows) * per_row]


def check_target_splits(target_spec: Spec, captured_rows: int, microbatches: int,
                        what: str) -> None:
    """Microbatches (gradient accumulation or pipelining) carry the same share of the
    target's rows as of the input's: refused at construction when the target's leading
    dimension is not a multiple of the input's rows."""
    if microbatches > 1 and target_rows_per_row(target_spec, captured_rows) is None:
        raise ValueError(
            f"{what}: the target's shape {tuple(int(d) for d in target_spec[0])} does not "
            f"follow the batch ({captured_rows} input rows: its leading dimension must be a "
            f"multiple of them), so num_microbatches={microbatches} cannot give each "
            "microbatch its share of the target. Return outputs whose leading dimension is "
            "the batch or a multiple of it (e.g. logits.reshape(B * T, V) with targets of "
            "shape (B * T,)), or set num_microbatches=1")


def leading_rows(arrays: Sequence[Any], specs: Sequence[Spec], captured_rows: int) -> int:
    """The rows of this batch: the leading dimension of the first input whose captured
    leading dimension is the batch. Raises naming the input when the batched inputs disagree
    (the trailing dimensions and dtypes are checked against the specs later)."""
    rows = None
    for i, (array, spec) in enumerate(zip(arrays, specs)):
        if not is_batched(spec, captured_rows):
            continue
        array_shape = np.shape(array)
        if not len(array_shape):
            raise ValueError(f"input {i}: expected an array with a leading batch dimension "
                             f"(captured shape {tuple(spec[0])}), got a scalar")
        if rows is None:
            rows = int(array_shape[0])
        elif int(array_shape[0]) != rows:
            raise ValueError(f"input {i} has {array_shape[0]} rows but input 0 has {rows}: "
                             "every input of a batch must have the same number of rows")
    return captured_rows if rows is None else rows


def microbatches(rows: int, count: int) -> List[int]:
    """The rows of each of ``count`` microbatches of a batch of ``rows`` rows, as even as they
    go (the first ones one row more: np.array_split's rule); fewer when the batch has fewer
    rows than ``count`` (every microbatch needs a row; the loss weights keep the mean that
    of the whole batch)."""
    count = max(1, min(int(count), int(rows))) if rows else 1
    base, extra = divmod(int(rows), count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def loss_weight(local_rows: int, rows_per_rank: Sequence[int]) -> float:
    """local_rows * N / global_rows: the factor that turns this rank's mean loss into its
    share of the global batch's mean once the step averages over the N ranks."""
    return local_rows * len(rows_per_rank) / sum(rows_per_rank)


def check_same_state(captured: Any, variant: Any, rows: int) -> None:
    """The step for ``rows`` rows must take the same parameters, optimizer state, frozen
    parameters and buffers as the captured step: they are shared between the two."""
    fields = ("param_names", "param_specs", "state_names", "hyper_names", "frozen_names",
              "frozen_specs", "buffer_names", "buffer_specs", "loss_weight_dtype", "row_states")

    def norm(value: Any) -> Any:
        return [tuple(x) if isinstance(x, (list, tuple)) else x for x in value] \
            if isinstance(value, (list, tuple)) else value

    differing = [f for f in fields if norm(getattr(captured, f)) != norm(getattr(variant, f))]
    if differing:
        raise ValueError(
            f"the model captured again at batch size {rows} has different "
            f"{', '.join(differing)} than the captured one (e.g. {differing[0]}: "
            f"{getattr(variant, differing[0])} vs {getattr(captured, differing[0])}); its "
            "state cannot be shared. Was the module changed after capture (requires_grad, "
            "new parameters)? Capture it again and build a new Trainer")
