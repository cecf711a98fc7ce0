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


def shard_model(model, plan: TensorParallelPlan, tp_rank: int, full_params: dict,
                values: bool = True):
    """``model`` with its forward (and evaluation forward) split by ``plan``, its parameters
    this tp rank's pieces of ``full_params`` (``values=False``: placeholders of the pieces'
    shapes, no memory) and a ``respecialize`` that splits the model captured at another
    batch size the same way."""
    trained = trained_names(model)
    functions = {}
    for gvar, func in model.mod.functions_items():
        if gvar.name_hint in ("forward", "forward_eval"):
            func = shard_forward(func, plan.tp, list(model.param_names), trained, plan)
        functions[gvar] = func
    mod = tvm.IRModule(functions)
    if values:
        init = {n: np.ascontiguousarray(plan.local_shard(n, np.asarray(full_params[n]),
                                                         tp_rank))
                for n in model.param_names}
    else:
        init = {n: np.broadcast_to(np.zeros((), np.asarray(full_params[n]).dtype),
                                   plan.local_shape(n, np.shape(full_params[n])))
                for n in model.param_names}

    shapes_only = model.without_values()  # the full initial values are not kept alive here

    def respecialize(rows):  # Model.at_batch gives the result this piece's init_params
        other = shapes_only.at_batch(rows)
        return shard_model(other, plan, tp_rank, other.init_params, values=False)

    return dataclasses.replace(model, mod=mod, init_params=init,
                               output_split_classes=plan.tp if plan.output_split else 0,
                               respecialize=respecialize if model.respecialize else None)
