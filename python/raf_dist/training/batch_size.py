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

import numpy as np

from ..distributed.communicator import raised_on_every_rank


@dataclasses.dataclass
class StepVariant:
    """The compiled step for one batch size (rows per rank)."""

    rows: int
    model: object  # the Model captured at this size
    signature: object  # its TrainStepSignature
    compiled: object  # its CompiledStep
    step_fn: object  # the VM's train_step
    kind: str = None  # None: a whole step; "partial" / "final": a microbatch's (accumulation)


def batched_spec(spec, rows: int, captured_rows: int):
    """``spec`` (shape, dtype) with its leading dimension ``rows`` when that dimension is the
    captured batch (a batched input or target), else unchanged."""
    shape, dtype = spec
    shape = tuple(int(d) for d in shape)
    if len(shape) and shape[0] == captured_rows:
        shape = (int(rows),) + shape[1:]
    return shape, dtype


def leading_rows(arrays, specs, captured_rows: int) -> int:
    """The rows of this batch: the leading dimension of the first input whose captured
    leading dimension is the batch. Raises naming the input when the batched inputs disagree
    (the trailing dimensions and dtypes are checked against the specs later)."""
    rows = None
    for i, (array, (shape, _)) in enumerate(zip(arrays, specs)):
        if not len(shape) or int(shape[0]) != captured_rows:
            continue
        array_shape = np.shape(array)
        if not len(array_shape):
            raise ValueError(f"input {i}: expected an array with a leading batch dimension "
                             f"(captured shape {tuple(shape)}), got a scalar")
        if rows is None:
            rows = int(array_shape[0])
        elif int(array_shape[0]) != rows:
            raise ValueError(f"input {i} has {array_shape[0]} rows but input 0 has {rows}: "
                             "every input of a batch must have the same number of rows")
    return captured_rows if rows is None else rows


def allgather_rows(mpi_comm, rows: int) -> list:
    """Every rank's row count (an mpi4py communicator's Iallgather). It polls, sleeping
    after the first hundred tests: a rank still compiling the step for a new size must not
    have its core taken by the others' busy-waiting (MPICH's blocking calls spin)."""
    from ..distributed.collectives import wait_request

    send, received = np.array([rows], np.int64), np.zeros(mpi_comm.Get_size(), np.int64)
    # a rank that never comes must not hang the others
    wait_request(mpi_comm.Iallgather(send, received),
                 "the exchange of every rank's batch rows before the step",
                 "a peer rank has probably died, stalled or is running a different program")
    return [int(r) for r in received]


def microbatches(rows: int, count: int) -> list:
    """The rows of each of ``count`` microbatches of a batch of ``rows`` rows, as even as they
    go (the first ones one row more: np.array_split's rule); fewer when the batch has fewer
    rows than ``count`` (every microbatch needs a row; the loss weights keep the mean that
    of the whole batch)."""
    count = max(1, min(int(count), int(rows))) if rows else 1
    base, extra = divmod(int(rows), count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def loss_weight(local_rows: int, rows_per_rank) -> float:
    """local_rows * N / global_rows: the factor that turns this rank's mean loss into its
    share of the global batch's mean once the step averages over the N ranks."""
    return local_rows * len(rows_per_rank) / sum(rows_per_rank)


def check_rows_per_rank(rows_per_rank, rank: int) -> None:
    """Every rank needs at least one row (a step of zero rows has no mean); raised on every
    rank together, since every rank sees the same counts."""
    empty = [r for r, rows in enumerate(rows_per_rank) if rows == 0]
    if empty:
        raise raised_on_every_rank(ValueError(
            f"ranks {empty} got no rows in this step (rows per rank: {list(rows_per_rank)}; "
            f"this is rank {rank}): every rank needs at least one row of the global batch. "
            "Use a global batch of at least as many rows as ranks, e.g. "
            "raf_dist.data.shard(..., drop_last=True) to drop a shorter tail"))


def check_same_state(captured, variant, rows: int) -> None:
    """The step for ``rows`` rows must take the same parameters, optimizer state, frozen
    parameters and buffers as the captured step: they are shared between the two."""
    fields = ("param_names", "param_specs", "state_names", "hyper_names", "frozen_names",
              "frozen_specs", "buffer_names", "buffer_specs", "loss_weight_dtype")

    def norm(value):
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
