"""The executors' shared handling of what a rank holds: the model split for tensor
parallelism, full tensors gathered back from shards (ZeRO over dp, pieces over tp), and the
optimizer state as ``{param: {state: full array}}``. The layout itself (which rank holds which
elements) is ``raf_dist.layout``; here are the collectives that reassemble it."""
import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..checkpoint import TrainState, host_array
from ..distributed import collectives
from ..layout import StateLayout
from ..training import tensor_parallel as tp_lib


def split_model(model: Any, tp: int, user_plan: Any, loss: str, comm: Any,
                tp_rank: int, keep_whole: Sequence[str] = ()) -> Tuple[Any, Any]:
    """(plan, ``model`` split across the tp ranks): the plan (found, or ``user_plan``
    checked; ``keep_whole`` never split), the full initial parameters of world rank 0 on
    every rank, this rank's pieces of them. Collective over the world; with no ``comm``
    (a builder planning a step: runtime/spmd_build.plan_step) the pieces as shapes only."""
    if comm is None:
        lean = model.without_values()
        plan = tp_lib.make_plan(lean, tp, user_plan, loss, keep_whole)
        return plan, tp_lib.shard_model(lean, plan, tp_rank, lean.init_params, values=False)
    plan = tp_lib.make_plan(model, tp, user_plan, loss, keep_whole)
    full = {}
    for name in model.param_names:
        value = np.ascontiguousarray(model.init_params[name]).copy()
        full[name] = collectives.broadcast(value, root=0) if comm.size > 1 else value
    return plan, tp_lib.shard_model(model, plan, tp_rank, full)


def full_parameter(plan: Any, name: str, local: np.ndarray, tp_group: int,
                   tp_size: int) -> np.ndarray:
    """The whole parameter ``name`` from every tp rank's piece (an allgather over the tp
    group; every tp rank must call it)."""
    if plan is None or name not in plan.placements:
        return local
    local = np.ascontiguousarray(local)
    flat = collectives.allgather(local.reshape(-1), group=tp_group)
    pieces = [flat[i * local.size:(i + 1) * local.size].reshape(local.shape)
              for i in range(tp_size)]
    return plan.assemble(name, pieces)


def full_table(plan: Any, name: str, local: np.ndarray, dp_group: int) -> np.ndarray:
    """The whole of ``name`` from every dp rank's rows of it when ``plan`` (an EmbeddingPlan)
    shards it (a broadcast from the owner table-wise, an allgather of the blocks row-wise;
    every dp rank must call it), else ``local``."""
    if plan is None or name not in plan.shapes:
        return local
    rows, row = int(plan.shapes[name][0]), tuple(local.shape[1:])  # a row of it (a state's
    if plan.mode == "table":                                       # may be (1,): per row)
        owner = plan.owners[name]
        whole = (np.ascontiguousarray(local) if local.shape[0] == rows
                 else np.empty((rows,) + row, dtype=local.dtype))
        return collectives.broadcast(whole, root=owner, group=dp_group)
    local = np.ascontiguousarray(local)
    flat = collectives.allgather(local.reshape(-1), group=dp_group)
    return flat.reshape((-1,) + row)[:rows]


def full_signature(executor: Any) -> Any:
    """The executor's step signature with every trained and frozen parameter of the full
    model at its true shape (what the ranks of a job agree on, what a checkpoint holds)."""
    model = executor.full_model
    specs = dict(zip(model.param_names, model.param_specs()))
    names = tp_lib.trained_names(model)
    frozen = [n for n in model.param_names if n not in set(names)]
    return dataclasses.replace(
        executor.signature, param_names=names, param_specs=[specs[n] for n in names],
        frozen_names=frozen, frozen_specs=[specs[n] for n in frozen])


def gather_shards(tensor: Any, shape: Sequence[int], world: int, dp_group: int) -> np.ndarray:
    """The whole tensor of ``shape`` from every dp rank's flat padded shard (a collective
    over dp when ``world`` > 1)."""
    numel = int(np.prod(shape, dtype=np.int64))
    shard = np.ascontiguousarray(host_array(tensor))
    if world == 1:
        return shard[:numel].reshape(shape)
    return collectives.allgather(shard, numel=numel, group=dp_group).reshape(shape)


def full_optimizer_states(layout: StateLayout, states: Sequence[Any], dp_group: int,
                          tp_plan: Optional[Any] = None, tp_group: int = -1,
                          tp: int = 1) -> Dict[str, Dict[str, np.ndarray]]:
    """{param: {state: full array}} of the state tensors ``states`` held under ``layout``:
    ZeRO's shards gathered over dp, tensor-parallel pieces over tp (every rank calls it)."""
    shapes = dict(zip(layout.param_names, layout.param_shapes))
    index = {n: i for i, n in enumerate(layout.param_names)}
    out: Dict[str, Dict[str, np.ndarray]] = {}
    held = layout.unpack_states([host_array(t) for t in states])
    for (param, state), value in held.items():
        full = (gather_shards(value, shapes[param], layout.dp_size, dp_group)
                if layout.states_sharded and not layout.is_local(index[param]) else value)
        if tp > 1:
            full = full_parameter(tp_plan, param, full, tp_group, tp)
        out.setdefault(param, {})[state] = full
    return out


def full_train_state(executor: Any, frozen_full: Dict[str, Any]) -> TrainState:
    """The TrainState of an executor whose ranks hold pieces of the model (tensor
    parallelism, pipeline stages): the full model (true shapes, every parameter) as a
    data-parallel world of every rank without ZeRO holds it. The files are then those of any
    other layout (ranges of the full flat tensors, one file per rank), so a checkpoint saved
    at tp x dp x pp reloads at any layout and the other way round: saving gathers each full
    tensor on every rank and writes this rank's range of it; loading reads the full tensors
    and the executor keeps its pieces. ``frozen_full``: the full frozen parameters when
    saving ({} when loading: not read)."""
    model = executor.full_model
    signature = full_signature(executor)
    frozen = signature.frozen_names
    return TrainState.of(executor.comm, executor.comm.size, 0, signature, executor.step_count,
                         executor.seed, executor.config, executor.loss, executor.optimizer,
                         model, [frozen_full.get(n) for n in frozen],
                         loop=executor.loop_state())
