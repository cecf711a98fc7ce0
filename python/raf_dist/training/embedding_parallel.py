"""A captured model with its embedding tables sharded over the data-parallel ranks
(passes/embedding_parallel.py), and the model this rank trains: the same parameter names, the
tables' shapes this rank's rows (table-wise: the whole table on its owner, (0, dim) elsewhere;
row-wise: one block of rows). The lookups exchange ids and rows by all-to-all; the dense
layers stay data parallel. Table-wise, each rank's forward differs (it looks up its own
tables), so each rank compiles its own step (after local rank 0's, which the SPMD build
order waits for; they cannot share a cache entry)."""
import logging
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np
import tvm

from ..passes.embedding_parallel import EmbeddingPlan, find_tables, lookup_count, \
    plan_embeddings, shard_embedding_forward
from .tensor_parallel import piece_model, trained_names

_LOG = logging.getLogger("raf_dist")


def make_plan(model: Any, mode: str, world: int,
              user_plan: Optional[Mapping[str, int]] = None) -> EmbeddingPlan:
    """The plan for ``model``'s tables over ``world`` dp ranks (raises ValueError naming a
    bad plan or a model without tables)."""
    tables = _tables(model)
    itemsize = max((np.dtype(model.init_params[n].dtype).itemsize for n in tables), default=4)
    return plan_embeddings(tables, mode, world, user_plan, itemsize)


def table_names(model: Any) -> Tuple[str, ...]:
    """The names of ``model``'s embedding tables (what ``make_plan`` would shard)."""
    return tuple(_tables(model))


def _tables(model: Any) -> Dict[str, Tuple[int, int]]:
    return find_tables(model.forward, list(model.param_names), trained_names(model))


def shard_model(model: Any, plan: EmbeddingPlan, rank: int, full_params: Dict[str, Any],
                values: bool = True) -> Any:
    """``model`` with its forwards looking up the tables by exchange and its tables this
    rank's rows of ``full_params`` (``values=False``: placeholders of their shapes); a
    ``respecialize`` that shards the model captured at another batch size the same way."""
    return piece_model(
        model, lambda m, func: shard_embedding_forward(func, plan, rank, list(m.param_names)),
        lambda n, full: plan.local_shard(n, full, rank),
        lambda n, shape: plan.local_shape(n, shape, rank), full_params, values)


class IdsCheck:
    """The check, before any exchange, that every id a step looks up is a row of its table
    (PyTorch raises IndexError for the same lookup; unchecked, an id outside the table would
    make the owner read past its table, or, row-wise, become a zero row on every rank). The
    ids are computed from the step's inputs by the forward's own ops
    (passes/embedding_parallel.py ``lookup_ids_function``), compiled once per batch size for
    the host. A lookup whose ids depend on more than the inputs is not checked (a warning
    names its table)."""

    def __init__(self, plan: EmbeddingPlan, full_model_at: Any, num_inputs: int) -> None:
        self.plan, self._full_model_at, self._num_inputs = plan, full_model_at, num_inputs
        self._functions: Dict[int, Any] = {}

    def _function(self, rows: int) -> Any:
        if rows not in self._functions:
            from tvm import relax

            from ..passes.embedding_parallel import lookup_ids_function

            model = self._full_model_at(rows)
            mod, names = lookup_ids_function(model.forward, self.plan.names,
                                             list(model.param_names), self._num_inputs)
            unchecked = lookup_count(model.forward, self.plan.names, list(model.param_names))
            for name in names:
                unchecked[name] -= 1
            for name, count in unchecked.items():
                if count:
                    _LOG.warning("embedding table %r: %d lookup(s) read ids computed from more "
                                 "than the step's inputs; their range is not checked", name,
                                 count)
            if mod is None:
                self._functions[rows] = (None, [])
            else:
                vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
                self._functions[rows] = (vm["lookup_ids"], names)
        return self._functions[rows]

    def __call__(self, inputs: Any, rows: int) -> None:
        """Raise ValueError naming the table and the id when an id of ``inputs`` (this
        rank's batch of ``rows`` rows) is outside its table."""
        message = self.message(inputs, rows)
        if message is not None:
            raise ValueError(message)

    def message(self, inputs: Any, rows: int) -> Optional[str]:
        """What ``__call__`` would raise, or None."""
        function, names = self._function(int(rows))
        if function is None:
            return None
        out = function(*[tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu())
                         for a in inputs[:self._num_inputs]])
        values = [out[i].numpy() for i in range(len(names))]
        for name, ids in zip(names, values):
            if ids.size == 0:
                continue
            table_rows = int(self.plan.shapes[name][0])
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= table_rows:
                bad = low if low < 0 else high
                return (f"embedding table {name!r} has {table_rows} rows and was asked for row "
                        f"{bad}: ids must be in [0, {table_rows}) (PyTorch raises IndexError "
                        "for the same lookup). Check this batch's ids (nothing was exchanged)")
        return None
