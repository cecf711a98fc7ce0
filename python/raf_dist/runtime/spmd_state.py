"""What the SPMD executor holds between steps, a step call's arguments, and its collective
side paths: the initial values every dp rank starts from (MPI: dp rank 0's broadcast), this
rank's pieces of full tensors (a checkpoint of another layout), and ``predict`` with sharded
embedding tables (the rows' agreement, the classes gathered over tp). Functions of the executor
(runtime/spmd_executor.py), which keeps the tensors."""
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tvm

from ..distributed import collectives
from ..distributed.communicator import raised_on_every_rank
from ..training import batch_size as batching
from . import batches
from . import predict as predict_lib
from .tensors import to_device


def initial_params(executor: Any, model: Any) -> Dict[str, np.ndarray]:
    """{name: array} of the trained parameters' start: dp rank 0's on every dp rank,
    whatever each rank's seed (MPI: a broadcast per parameter under data parallelism)."""
    signature, ep_plan = executor.signature, executor.ep_plan
    init = {n: np.ascontiguousarray(model.init_params[n]) for n in signature.param_names}
    if executor.parallel.grad_world > 1:
        for name in signature.param_names:
            if ep_plan is not None and name in ep_plan.shapes:
                continue  # this rank's rows of rank 0's table (spmd_build.split_for_embeddings)
            init[name] = collectives.broadcast(init[name].copy(), root=0,
                                               group=executor.dp_group)
    return init


def initial_frozen(executor: Any, model: Any) -> List[Any]:
    """Runtime tensors of the frozen parameters (full on every rank: rank 0's values)."""
    frozen = []
    for name in executor.signature.frozen_names:
        value = np.ascontiguousarray(model.init_params[name]).copy()
        if executor.parallel.grad_world > 1:
            value = collectives.broadcast(value, root=0, group=executor.dp_group)
        frozen.append(tvm.runtime.tensor(value, executor._device))
    return frozen


def pieces(executor: Any, params: Sequence[Any], states: Dict[Any, Any],
           frozen: Dict[str, Any]) -> Tuple[List[Any], Dict[Any, Any], Dict[str, Any]]:
    """This rank's pieces of full parameters (signature order), optimizer states and frozen
    parameters: its tp piece, then its dp shard where ZeRO shards them."""
    tp_plan, ep_plan, layout = executor.tp_plan, executor.ep_plan, executor.layout

    def piece(name: str, array: Any) -> np.ndarray:
        array = np.asarray(array)
        if tp_plan is not None:  # this tp rank's piece (a table stays whole)
            array = tp_plan.local_shard(name, array, executor.mesh.tp_rank)
        if ep_plan is not None:  # this dp rank's rows of a sharded table
            array = ep_plan.local_shard(name, array, executor.dp_rank)
        return array

    names = executor.signature.param_names
    index = {n: i for i, n in enumerate(names)}
    out = [piece(n, p) for n, p in zip(names, params)]
    if layout.params_sharded:
        out = [layout.shard_param(i, p) for i, p in enumerate(out)]
    mine = {k: piece(k[0], v) for k, v in states.items()}
    if layout.states_sharded:
        mine = {k: layout.shard_param(index[k[0]], v) for k, v in mine.items()}
    return out, mine, {n: piece(n, v) for n, v in frozen.items()}


def check_sharded_tables_batch(rows_per_rank: Sequence[int], bad: Sequence[int],
                               bad_ids: Any) -> None:
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
            f"embedding_parallel with different rows per rank ({list(rows_per_rank)}) is not "
            "supported: the tables' exchanges are compiled for equal batches. Use "
            "raf_dist.data.shard(..., drop_last=True)"))


def agree_on_predict_rows(executor: Any, inputs: Sequence[Any], rows: int) -> None:
    """``predict`` with sharded tables, before any exchange: this rank checks every id of
    ``inputs`` (at the captured batch size: the step's compiled check) and the dp ranks
    exchange their row counts, verdicts and a checksum of their rows in one small
    allgather; a bad id, or ranks with other rows, is a ValueError on every rank."""
    specs, batch = executor.signature.input_specs, executor.batch_size
    bad_ids = None
    for start in range(0, rows, batch):
        count = min(batch, rows - start)
        bad_ids = bad_ids or executor.builder.check_ids.message(
            predict_lib.rows_of(inputs, specs, batch, start, count, batch), batch)
    checksum = 0
    for array in inputs:
        checksum = zlib.crc32(np.ascontiguousarray(array).view(np.uint8).tobytes(), checksum)
    rows_per_rank, bad, checksums = zip(*batches.allgather_ints(
        executor.dp_comm, [rows, int(bad_ids is not None), checksum],
        "the exchange of every rank's rows before predict()"))
    if bad_ids is None and not any(bad) and (len(set(rows_per_rank)) > 1
                                             or len(set(checksums)) > 1):
        raise raised_on_every_rank(ValueError(
            f"predict() with sharded embedding tables got other rows on other ranks "
            f"({list(rows_per_rank)} rows by rank, {len(set(checksums))} different "
            "contents): every rank must pass the same rows (each computes a share of "
            "them, looking up the others' tables)"))
    check_sharded_tables_batch(rows_per_rank, bad, bad_ids)


def gather_classes(executor: Any, piece: np.ndarray) -> np.ndarray:
    """The whole output from every tp rank's slice of its last (class) dimension."""
    tp = executor.parallel.tp
    piece = np.ascontiguousarray(piece)
    flat = collectives.allgather(piece.reshape(-1), group=executor.mesh.tp_group)
    return np.concatenate(np.split(flat.reshape((tp,) + piece.shape), tp),
                          axis=-1).reshape(piece.shape[:-1] + (piece.shape[-1] * tp,))[
        ..., :executor.tp_plan.output_classes]  # a padded vocabulary's padding cut off


def predict_shared(executor: Any, inputs: Sequence[Any], rows: int, run_piece: Any) -> Any:
    """Sharded tables: each dp rank computes an equal share of the rows (the last share
    padded), its lookups exchanged with the holders as in a step; the shares are
    allgathered."""
    specs, batch, world = executor.signature.input_specs, executor.batch_size, \
        executor.parallel.grad_world
    respecialize = executor.model.respecialize is not None
    share = -(-rows // world)
    start = executor.dp_rank * share
    mine = predict_lib.rows_of(inputs, specs, batch, start, max(0, min(share, rows - start)),
                               share)
    out = np.ascontiguousarray(predict_lib.in_pieces(mine, specs, batch, respecialize,
                                                     run_piece))
    shares = collectives.allgather(out.reshape(-1), group=executor.dp_group)
    return shares.reshape((world * out.shape[0],) + out.shape[1:])[
        :rows * (out.shape[0] // share)]


def step_inputs(executor: Any, variant: Any, inputs: Sequence[Any], y: Any, start: int,
                rows: int, rows_per_rank: Sequence[int],
                microbatch: Optional[int]) -> List[Any]:
    """The data arguments of one step call: rows [start, start + rows) of every batched
    input and of the target (all of them when ``microbatch`` is None), the dropout masks,
    the frozen parameters, the loss weight (this piece's share of the global batch)."""
    signature, captured = variant.signature, executor.batch_size

    def piece(array: Any, spec: Any) -> Any:
        array = np.asarray(array)
        if microbatch is not None and len(spec[0]) and int(spec[0][0]) == captured:
            return array[start:start + rows]
        return array

    args = [to_device(piece(a, spec), vspec, f"input {i}", executor._device) for i, (a, spec, vspec)
            in enumerate(zip(inputs, executor.signature.input_specs, signature.input_specs))]
    args += [tvm.runtime.tensor(m, executor._device) for m in executor.dropout_masks(
        executor.step_count + 1, rows, microbatch)]
    args += executor._frozen
    target = y
    if microbatch is not None:  # this microbatch's share of the target's rows
        per_row: Any = batching.target_rows_per_row(executor.signature.target_spec, captured)
        target = batching.target_piece(y, start, rows, per_row)
    args.append(to_device(target, signature.target_spec, "target", executor._device))
    if signature.loss_weight_dtype is not None:  # this piece's share of the global batch
        weight = batching.loss_weight(rows, rows_per_rank)
        if executor._scaler is not None:  # and the loss scale (a power of two: exact)
            weight *= executor._scaler.scale
        args.append(tvm.runtime.tensor(np.array(weight, dtype=signature.loss_weight_dtype),
                                       executor._device))
    return args

def zero_accumulators(executor: Any) -> List[Any]:
    """Gradient accumulators (one per trained parameter, as this rank holds it) and the
    loss accumulator, zero at the start of a step."""
    specs = executor.signature.param_specs
    return ([tvm.runtime.tensor(np.zeros(s, d), executor._device) for s, d in specs]
            + [tvm.runtime.tensor(np.zeros((), executor._hyper_dtype), executor._device)])
