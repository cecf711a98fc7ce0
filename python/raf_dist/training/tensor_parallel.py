"""A captured model, split for tensor parallelism (DESIGN.md 3b), and what the Trainer needs
around it: the plan, this tp rank's pieces of the parameters, and the full parameters back.

The forward is rewritten once per batch size with the same plan (passes/tensor_parallel.py);
parameter names and order do not change, their shapes become the local pieces. Which piece a
rank holds is decided here, when parameters are loaded, not in the IR: one compiled step
serves every rank (SPMD).
"""
import dataclasses

import numpy as np
import tvm

from ..passes.tensor_parallel import TensorParallelPlan, plan_tensor_parallel, shard_forward


def trained_names(model):
    frozen = set(model.frozen_params)
    return [n for n in model.param_names if n not in frozen]


def make_plan(model, tp: int, plan=None, loss="cross_entropy") -> TensorParallelPlan:
    """The plan for ``model`` at ``tp`` ranks: found on the captured graph, or ``plan``
    ({pattern: "colwise" | "rowwise" | "replicate"}) checked against it. With
    cross-entropy the output head may stay split along the classes (vocabulary parallel)."""
    return plan_tensor_parallel(model.forward, tp, list(model.param_names), trained_names(model),
                                plan=plan, split_output=loss == "cross_entropy")


def shard_model(model, plan: TensorParallelPlan, tp_rank: int, full_params: dict):
    """``model`` with its forward (and evaluation forward) split by ``plan``, its parameters
    this tp rank's pieces of ``full_params`` and a ``respecialize`` that splits the model
    captured at another batch size the same way."""
    trained = trained_names(model)
    functions = {}
    for gvar, func in model.mod.functions_items():
        if gvar.name_hint in ("forward", "forward_eval"):
            func = shard_forward(func, plan.tp, list(model.param_names), trained, plan)
        functions[gvar] = func
    mod = tvm.IRModule(functions)
    init = {n: np.ascontiguousarray(plan.local_shard(n, np.asarray(full_params[n]), tp_rank))
            for n in model.param_names}

    def respecialize(rows):  # the Trainer keeps its own parameter tensors: no init values
        other = model.at_batch(rows)  # are kept here (the full ones would stay alive)
        return shard_model(other, plan, tp_rank, other.init_params)

    return dataclasses.replace(model, mod=mod, init_params=init,
                               output_split_classes=plan.tp if plan.output_split else 0,
                               respecialize=respecialize if model.respecialize else None)


def full_parameter(plan, name, local, tp_group, tp_size):
    """The whole parameter ``name`` from every tp rank's piece (an allgather over the tp
    group; every tp rank must call it)."""
    from ..distributed import collectives

    if name not in plan.placements:
        return local
    local = np.ascontiguousarray(local)
    flat = collectives.allgather(local.reshape(-1), group=tp_group)
    pieces = [flat[i * local.size:(i + 1) * local.size].reshape(local.shape)
              for i in range(tp_size)]
    return plan.assemble(name, pieces)


class CheckpointView:
    """What ``raf_dist.checkpoint`` reads of a Trainer whose ranks hold pieces of the model
    (tensor parallelism, pipeline stages): the full model (true shapes, every parameter),
    held as by a data-parallel world of every rank without ZeRO. The files are then those of
    any other layout (ranges of the full flat tensors, one file per rank), so a checkpoint
    saved at tp x dp x pp reloads at any layout and the other way round. Saving gathers each
    full tensor on every rank (over tp, pp, and dp under ZeRO) and writes this rank's range of
    it; loading reads the full tensors and the trainer keeps its pieces. ``frozen_full``:
    the full frozen parameters when saving ({} when loading: not read)."""

    def __init__(self, trainer, frozen_full):
        model = trainer.full_model
        specs = dict(zip(model.param_names, model.param_specs()))
        names = trained_names(model)
        frozen = [n for n in model.param_names if n not in set(names)]
        self.comm = trainer.comm
        self.data_parallel, self.world, self.zero_level = True, trainer.comm.size, 0
        self.step_count, self.seed = trainer.step_count, trainer.seed
        self.config, self.loss, self.optimizer = trainer.config, trainer.loss, trainer.optimizer
        self.model = model
        self.signature = dataclasses.replace(
            trainer.signature, param_names=names, param_specs=[specs[n] for n in names],
            frozen_names=frozen, frozen_specs=[specs[n] for n in frozen])
        self._frozen = [frozen_full.get(n) for n in frozen]
