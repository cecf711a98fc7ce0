"""A captured model, split for tensor parallelism (DESIGN.md 3b), and what the Trainer needs
around it: the plan, this tp rank's pieces of the parameters, and the full parameters back.

The forward is rewritten once per batch size with the same plan (passes/tensor_parallel.py);
parameter names and order do not change, their shapes become the local pieces. Which piece a
rank holds is decided here, when parameters are loaded, not in the IR: one compiled step
serves every rank (SPMD).
"""
import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tvm

from ..model import Model
from ..passes.tensor_parallel import plan_tensor_parallel
from ..passes.tp_plan import TensorParallelPlan
from ..passes.tp_shard import shard_forward

#: ``rewrite(model, func)``: a forward of ``model`` as a rank holding pieces runs it
Rewrite = Callable[[Model, Any], Any]


def trained_names(model: Model) -> List[str]:
    """``model``'s parameter names without the frozen ones, in order."""
    frozen = set(model.frozen_params)
    return [n for n in model.param_names if n not in frozen]


def make_plan(model: Model, tp: int, plan: Optional[Mapping[str, str]] = None,
              loss: str = "cross_entropy", keep_whole: Sequence[str] = ()) -> TensorParallelPlan:
    """The plan for ``model`` at ``tp`` ranks: found on the captured graph, or ``plan``
    ({pattern: "colwise" | "rowwise" | "replicate"}) checked against it. With
    cross-entropy the output head may stay split along the classes (vocabulary parallel).
    ``keep_whole``: parameters no tp rank splits (the embedding tables embedding_parallel
    shards over the dp ranks)."""
    return plan_tensor_parallel(model.forward, tp, list(model.param_names), trained_names(model),
                                plan=plan, split_output=loss == "cross_entropy",
                                keep_whole=keep_whole)


def shard_model(model: Model, plan: TensorParallelPlan, tp_rank: int,
                full_params: Mapping[str, Any], values: bool = True) -> Model:
    """``model`` with its forward (and evaluation forward) split by ``plan``, its parameters
    this tp rank's pieces of ``full_params`` (``values=False``: placeholders of the pieces'
    shapes, no memory) and a ``respecialize`` that splits the model captured at another
    batch size the same way."""
    return piece_model(
        model, lambda m, func: shard_forward(func, plan.tp, list(m.param_names),
                                             trained_names(m), plan),
        lambda n, full: plan.local_shard(n, full, tp_rank), plan.local_shape, full_params,
        values, output_split_classes=plan.tp if plan.output_split else 0)


def piece_model(model: Model, rewrite: Rewrite, local_shard: Callable[[str, np.ndarray], Any],
                local_shape: Callable[[str, Tuple[int, ...]], Tuple[int, ...]],
                full_params: Mapping[str, Any], values: bool = True, **fields: Any) -> Model:
    """What a rank keeps of ``model`` when a parallelism splits parameters across ranks
    (tensor parallelism here, embedding tables in training/embedding_parallel.py): its
    forward and evaluation forward ``rewrite(model, func)``; its parameters
    ``local_shard(name, full)`` of ``full_params`` (``values=False``: read-only placeholders
    of ``local_shape(name, full shape)``, no memory); ``fields`` set on the result; and a
    ``respecialize`` that captures another batch size and splits it the same way."""
    functions = {gvar: rewrite(model, func) if gvar.name_hint in ("forward", "forward_eval")
                 else func for gvar, func in model.mod.functions_items()}
    init: Dict[str, np.ndarray] = {}
    for n in model.param_names:
        full = np.asarray(full_params[n])
        init[n] = (np.ascontiguousarray(local_shard(n, full)) if values else
                   np.broadcast_to(np.zeros((), full.dtype), local_shape(n, full.shape)))

    shapes_only = model.without_values()  # the full initial values are not kept alive here

    # Model.at_batch gives the result this piece's init_params
    def respecialize(rows: int) -> Model:
        other = shapes_only.at_batch(rows)
        return piece_model(other, rewrite, local_shard, local_shape, other.init_params,
                           values=False, **fields)

    return dataclasses.replace(model, mod=tvm.IRModule(functions), init_params=init,
                               respecialize=respecialize if model.respecialize else None,
                               **fields)
