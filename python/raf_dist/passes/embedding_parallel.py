"""Embedding-table parallelism (DESIGN.md section 1, "Embedding tables"): the tables of a
recommender sharded over the data-parallel ranks, the dense layers left data parallel.

A *table* is a trained 2-D parameter every use of which is a row lookup ``take(W, ids,
axis=0)`` (what ``nn.Embedding`` and ``nn.EmbeddingBag`` capture to; a table also used as a
matrix, e.g. a language model's tied output head, is not one). ``plan_embeddings`` decides
which rows of each table each rank holds:

- ``"table"`` (DLRM's model parallelism, torchrec's table-wise): each table whole on one
  rank, chosen greedily by bytes (largest table first, to the rank holding the fewest bytes)
  or by a user plan ``{table name or pattern: rank}``; the other ranks hold none of its rows;
- ``"row"`` (torchrec's row-wise): rank r holds rows ``[r * b, (r + 1) * b)`` with
  ``b = ceil(rows / N)``, the last block zero padded.

``shard_embedding_forward`` rewrites every lookup of the forward (before autodiff, as the
tensor-parallel pass does) into the personalised all-to-all of the DLRM paper:

1. every rank sends the ids it looks up to the ranks that hold rows of the table (one
   ``raf_dist.ep_exchange``: the table's owner, or every rank row-wise);
2. each holder looks up its rows for the ids of every rank (row-wise: ids outside its block
   masked to zero rows, the partial results of a sum);
3. the rows go back by the reverse exchange (row-wise: the N partial results of each id are
   summed on the rank that asked: a reduce-scatter as all-to-all plus sum).

The exchange's gradient is the reverse exchange, so TVM's Gradient pass emits the backward
all-to-alls (the rows' gradients sent to their holders) and ``take``'s own gradient scatters
them into the held rows. A rank that holds no row of a table keeps a (0, dim) parameter of it:
its lookups and their gradients are empty tensors, but they are there, so that rank's half of
every exchange is on the path from the loss to a parameter and no pass drops it (a collective
only some ranks run would hang the others).

An ``nn.EmbeddingBag``'s bags are pooled on the holders and pooled vectors travel back
(passes/embedding_pooled.py: the ids go out with their bag numbers); a plain ``nn.Embedding``
lookup (or rows used for anything besides their bag's sum) travels as rows.

``LowerEmbeddingExchange(group)`` (after autodiff) turns each exchange into a blocking
``raf_dist.ccl.alltoall`` with the split counts as constants (alltoallv; the native runtime's
counters, timeouts, flight recorder and mismatch checks apply).
"""
import dataclasses
import fnmatch
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tvm
from tvm import relax

from ..ir.ops import ep_exchange, is_ep_exchange
from .embedding_pooled import find_pooled, pooled_exchange_bytes, pooled_lookup
from .bucketing import collective
from .gradient_markers import SubstituteVars
from .lower_allreduce import lower_blocking, lower_functions

MODES = ("none", "table", "row")
_TAKE = tvm.ir.Op.get("relax.take")


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
    """Which rows of each table (parameter name -> full (rows, dim)) each of ``world`` dp
    ranks holds (module docstring). ``owners``: the table-wise placement."""

    mode: str
    world: int
    shapes: Mapping[str, Tuple[int, int]]
    owners: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def names(self) -> List[str]:
        return list(self.shapes)

    def block_rows(self, name: str) -> int:
        """Rows of one row-wise block (ceil(rows / N))."""
        return -(-int(self.shapes[name][0]) // self.world)

    def local_rows(self, name: str, rank: int) -> int:
        """Rows of the tensor rank ``rank`` holds of table ``name`` (padding included)."""
        if self.mode == "row":
            return self.block_rows(name)
        return int(self.shapes[name][0]) if self.owners[name] == rank else 0

    def row_range(self, name: str, rank: int) -> Tuple[int, int]:
        """[begin, end) of the table's real rows rank ``rank`` holds."""
        rows = int(self.shapes[name][0])
        if self.mode == "row":
            b = self.block_rows(name)
            return min(rows, rank * b), min(rows, (rank + 1) * b)
        return (0, rows) if self.owners[name] == rank else (0, 0)

    def holders(self, name: str) -> List[int]:
        """The ranks that look up rows of ``name`` (hold a non-empty tensor of it)."""
        return [r for r in range(self.world) if self.local_rows(name, r) > 0]

    def local_shape(self, name: str, shape: Sequence[int], rank: int) -> Tuple[int, ...]:
        if name not in self.shapes:
            return tuple(int(d) for d in shape)
        # a table's trailing shape is its dim; a per-row optimizer state's is (1,)
        return (self.local_rows(name, rank),) + tuple(int(d) for d in shape[1:])

    def local_shard(self, name: str, array: np.ndarray, rank: int) -> np.ndarray:
        """Rank ``rank``'s tensor of the full table (or any full parameter: itself)."""
        if name not in self.shapes:
            return array
        begin, end = self.row_range(name, rank)
        out = np.zeros(self.local_shape(name, array.shape, rank), dtype=array.dtype)
        out[:end - begin] = array[begin:end]
        return out

    def assemble(self, name: str, pieces: Sequence[np.ndarray]) -> np.ndarray:
        """The full table from every rank's tensor (rank order)."""
        rows = int(self.shapes[name][0])
        if self.mode == "table":
            return pieces[self.owners[name]]
        return np.concatenate(list(pieces), axis=0)[:rows]

    def held_bytes(self, rank: int, itemsize: int = 4) -> int:
        """Bytes of table rows rank ``rank`` holds (padding included)."""
        return sum(self.local_rows(n, rank) * int(self.shapes[n][1]) * itemsize
                   for n in self.shapes)

    def describe(self) -> Dict[str, object]:
        """What the ranks must agree on (the Trainer's fingerprint)."""
        return {"mode": self.mode, "world": self.world,
                "tables": {n: list(s) for n, s in self.shapes.items()},
                "owners": dict(self.owners)}


def _lookups(func: relax.Function) -> Tuple[Dict[relax.Var, int], Dict[relax.Var, int]]:
    """({param var: row lookups of it}, {param var: any other use})."""
    takes: Dict[relax.Var, int] = {}
    other: Dict[relax.Var, int] = {}
    params = set(func.params)

    def count(expr, into):
        for var in relax.analysis.free_vars(expr):
            if var in params:
                into[var] = into.get(var, 0) + 1

    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if (isinstance(value, relax.Call) and value.op.same_as(_TAKE)
                    and isinstance(value.args[0], relax.Var) and value.args[0] in params
                    and value.attrs.axis is not None and int(value.attrs.axis) == 0):
                takes[value.args[0]] = takes.get(value.args[0], 0) + 1
                count(value.args[1], other)
            else:
                count(value, other)
    count(func.body.body, other)
    return takes, other


def lookup_count(func: relax.Function, tables: Sequence[str],
                 param_names: Sequence[str]) -> Dict[str, int]:
    """{table: row lookups of it in ``func``}."""
    from .tensor_parallel import vars_by_name

    by_name = vars_by_name(func, list(param_names))
    takes, _ = _lookups(func)
    return {n: takes.get(by_name[n], 0) for n in tables if n in by_name}


def find_tables(func: relax.Function, param_names: Sequence[str],
                trained: Sequence[str]) -> Dict[str, Tuple[int, int]]:
    """{name: (rows, dim)} of the trained 2-D parameters of ``func`` (a captured forward)
    used only as lookup tables (module docstring), in parameter order."""
    from .tensor_parallel import vars_by_name

    by_name = vars_by_name(func, list(param_names))
    takes, other = _lookups(func)
    tables = {}
    for name in param_names:
        var = by_name[name]
        shape = [int(d) for d in var.ty.shape]
        if name in trained and len(shape) == 2 and takes.get(var) and not other.get(var):
            tables[name] = (shape[0], shape[1])
    return tables


def _matches(pattern: str, name: str) -> bool:
    """A plan key names a table by parameter name ("tables.3.weight") or module name
    ("tables.3"), or an fnmatch pattern of either."""
    module = name[:-len(".weight")] if name.endswith(".weight") else name
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(module, pattern)


def plan_embeddings(tables: Mapping[str, Tuple[int, int]], mode: str, world: int,
                    user_plan: Optional[Mapping[str, int]] = None,
                    itemsize: int = 4) -> EmbeddingPlan:
    """The plan for ``tables`` over ``world`` dp ranks (module docstring). ``user_plan``
    ({table or pattern: rank}, table-wise only) places the tables it names; the greedy
    balance by bytes places the rest around them. A bad plan raises ValueError naming it
    (the same on every rank: nothing here depends on the rank)."""
    if mode not in ("table", "row"):
        raise ValueError(f"embedding_parallel must be one of {MODES}, got {mode!r}")
    if not tables:
        raise ValueError(
            f"embedding_parallel={mode!r} found no embedding table in the model: a table is a "
            "trained 2-D parameter used only by row lookups (nn.Embedding, nn.EmbeddingBag; "
            "not one tied to an output layer). Set embedding_parallel='none'")
    owners: Dict[str, int] = {}
    if user_plan:
        if mode != "table":
            raise ValueError("embedding_plan places whole tables: it needs "
                             "embedding_parallel='table' (row-wise splits every table)")
        for key, rank in user_plan.items():
            hits = [n for n in tables if _matches(str(key), n)]
            if not hits:
                raise ValueError(f"embedding_plan names {key!r}, which is no embedding table of "
                                 f"the model; the tables are: {', '.join(tables)}")
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) \
                    or not 0 <= int(rank) < world:
                raise ValueError(f"embedding_plan puts {key!r} on rank {rank!r}, outside the "
                                 f"data-parallel group of {world} ranks (0 .. {world - 1})")
            for n in hits:
                owners[n] = int(rank)
    if mode == "table":
        held = [0] * world
        for n, r in owners.items():
            held[r] += tables[n][0] * tables[n][1] * itemsize
        rest = sorted((n for n in tables if n not in owners),
                      key=lambda n: (-tables[n][0] * tables[n][1], list(tables).index(n)))
        for n in rest:  # largest first, to the rank holding the fewest bytes
            r = min(range(world), key=lambda k: (held[k], k))
            owners[n] = r
            held[r] += tables[n][0] * tables[n][1] * itemsize
        owners = {n: owners[n] for n in tables}
    return EmbeddingPlan(mode, int(world), dict(tables), owners)


def shard_embedding_forward(func: relax.Function, plan: EmbeddingPlan, rank: int,
                            param_names: Sequence[str]) -> relax.Function:
    """``func`` (a forward) with every lookup of a table of ``plan`` done by exchange with
    the table's holders (module docstring), the tables' parameters this rank's tensors."""
    from .tensor_parallel import vars_by_name

    by_name = vars_by_name(func, list(param_names))
    table_of = {by_name[n]: n for n in plan.names if n in by_name}
    var_map: Dict[relax.Var, relax.Expr] = {}
    new_params = []
    for p in func.params:
        if p in table_of:
            name = table_of[p]
            var_map[p] = relax.Var(p.name, relax.TensorType(
                plan.local_shape(name, plan.shapes[name], rank), p.ty.dtype))
            new_params.append(var_map[p])
        else:
            new_params.append(p)
    bb = relax.BlockBuilder()
    attrs = dict(func.attrs) if func.attrs is not None else {}
    fname = str(attrs.pop("global_symbol", "forward"))
    # bags pooled on the holders (passes/embedding_pooled.py): their rows' bindings go
    pooled = find_pooled(func, list(table_of))
    folded = {v for site in pooled.values() for v in (site.take, site.scaled) if v is not None}

    def substitute(expr):
        return SubstituteVars(var_map).visit_expr(expr)

    def emit(binding, output):
        value = binding.value
        if binding.var in folded:
            return
        site = pooled.get(binding.var)
        if site is not None:
            rows = pooled_lookup(bb, plan, table_of[site.table], rank, var_map[site.table],
                                 substitute(site.ids), substitute(site.member),
                                 None if site.weights is None else substitute(site.weights),
                                 substitute(site.bag_of),
                                 None if site.keep is None else substitute(site.keep))
        elif (isinstance(value, relax.Call) and value.op.same_as(_TAKE)
                and isinstance(value.args[0], relax.Var) and value.args[0] in table_of):
            name = table_of[value.args[0]]
            rows = _lookup(bb, plan, name, rank, var_map[value.args[0]],
                           substitute(value.args[1]))
        else:
            rows = substitute(value)
        var = (bb.emit_output(rows, name_hint=binding.var.name) if output
               else bb.emit(rows, name_hint=binding.var.name))
        var_map[binding.var] = var

    with bb.function(fname, new_params, attrs=attrs, pure=True):
        for block in func.body.blocks:
            if isinstance(block, relax.DataflowBlock):
                with bb.dataflow():
                    for b in block.bindings:
                        emit(b, output=not isinstance(b.var, relax.DataflowVar))
            else:
                for b in block.bindings:
                    emit(b, output=False)
        bb.emit_func_output(substitute(func.body.body))
    return bb.get()[fname]


def _lookup(bb: relax.BlockBuilder, plan: EmbeddingPlan, name: str, rank: int,
            table: relax.Var, ids: relax.Expr) -> relax.Expr:
    """The rows ``table[ids]`` of the full table, by exchange with its holders."""
    op = relax.op
    ids = bb.normalize(ids)
    shape = [int(d) for d in ids.ty.shape]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    dim, dtype = int(plan.shapes[name][1]), str(table.ty.dtype)
    holders = plan.holders(name)
    world = plan.world
    flat = bb.emit(op.reshape(ids, [count])) if shape != [count] else ids
    if str(ids.ty.dtype) == "int64" and int(plan.shapes[name][0]) < 2**31:
        flat = bb.emit(op.astype(flat, "int32"))  # half the bytes on the wire
    ids = flat
    send = [count if j in holders else 0 for j in range(world)]
    recv = [count] * world if rank in holders else [0] * world
    outgoing = bb.emit(op.tile(flat, [len(holders)])) if len(holders) > 1 else flat
    got = bb.emit(ep_exchange(outgoing, send, recv))
    if plan.mode == "row":  # ids outside this rank's block: zero rows (a partial sum)
        index_dtype = str(ids.ty.dtype)
        begin = plan.row_range(name, rank)[0] if rank in holders else 0
        local = bb.emit(op.subtract(got, relax.const(begin, index_dtype)))
        inside = bb.emit(op.logical_and(
            op.greater_equal(local, relax.const(0, index_dtype)),
            op.less(local, relax.const(plan.block_rows(name), index_dtype))))
        safe = bb.emit(op.where(inside, local, relax.const(0, index_dtype)))
        rows = bb.emit(op.multiply(op.take(table, safe, axis=0),
                                   op.expand_dims(op.astype(inside, dtype), 1)))
    else:
        rows = bb.emit(op.take(table, got, axis=0))
    back = bb.emit(ep_exchange(rows, recv, send))  # (holders * count, dim)
    if len(holders) > 1:
        back = bb.emit(op.sum(op.reshape(back, [len(holders), count, dim]), axis=[0]))
    return op.reshape(back, shape + [dim]) if shape != [count] else back


def exchange_bytes(plan: EmbeddingPlan, rank: int, lookups: Mapping[str, Sequence],
                   id_bytes: int = 4, row_bytes: int = 4) -> int:
    """The bytes rank ``rank`` sends to other ranks in one training step's exchanges (the
    native counters' alltoall bus bytes): ``lookups`` {table: its lookups}, each the number
    of ids it looks up or, for a bag pooling (passes/embedding_pooled.py), (ids, bags,
    weighted) (every rank looks up as many ids; ids travel as int32 below 2**31 rows).
    Forward: the ids to each holder, the rows back from a holder; backward: the rows'
    gradients to each holder."""
    total = 0
    for name, counts in lookups.items():
        holders = plan.holders(name)
        dim = int(plan.shapes[name][1])
        others = [h for h in holders if h != rank]
        for k in counts:
            if isinstance(k, tuple):
                total += pooled_exchange_bytes(plan, rank, name, *k, id_bytes=id_bytes,
                                               row_bytes=row_bytes)
                continue
            total += len(others) * k * id_bytes  # ids out
            if rank in holders:  # rows to every other rank
                total += (plan.world - 1) * k * dim * row_bytes
            total += len(others) * k * dim * row_bytes  # gradients to the holders
    return total


# ---- lowering -----------------------------------------------------------------------------
def _alltoall(group):
    def call(value, out):  # the split counts in elements, int64 host constants
        x = value.args[0]
        row = int(np.prod([int(d) for d in list(x.ty.shape)[1:]], dtype=np.int64))
        send = np.array([int(r) * row for r in value.attrs["send"]], dtype=np.int64)
        recv = np.array([int(r) * row for r in value.attrs["recv"]], dtype=np.int64)
        return collective("raf_dist.ccl.alltoall", x, relax.const(send, "int64"),
                          relax.const(recv, "int64"), relax.prim_value(group), out)

    return call


@tvm.transform.module_pass(opt_level=0, name="LowerEmbeddingExchange")
class LowerEmbeddingExchange:
    """After autodiff: each ``raf_dist.ep_exchange`` becomes a blocking
    ``raf_dist.ccl.alltoall(send, send_counts, recv_counts, group, recv)`` over native process
    group ``group`` (the dp axis; passes/lower_allreduce.py ``lower_blocking``)."""

    def __init__(self, group: int):
        self.group = int(group)

    def transform_module(self, mod, ctx):
        return lower_functions(mod, lambda func: lower_blocking(
            func, is_ep_exchange, _alltoall(self.group), "alltoall"))


# ---- the ids a step looks up, for the range check before any exchange ----------------------
def lookup_ids_function(func: relax.Function, tables: Sequence[str], param_names: Sequence[str],
                        num_inputs: int) -> Tuple[Optional[tvm.IRModule], List[str]]:
    """(``ids(*inputs) -> (ids of each lookup, ...)``, the table of each lookup): the part of
    forward ``func`` that computes the ids its table lookups read from the data inputs alone
    (the first ``num_inputs`` arguments), so the host can check them before any exchange.
    Lookups whose ids depend on anything else (a parameter, a mask) are left out. (None, [])
    when no lookup qualifies."""
    from .tensor_parallel import vars_by_name

    by_name = vars_by_name(func, list(param_names))
    table_of = {by_name[n]: n for n in tables if n in by_name}
    inputs = list(func.params[:num_inputs])
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    order = [b.var for block in func.body.blocks for b in block.bindings]
    from_inputs: Dict[relax.Var, bool] = {v: True for v in inputs}

    def data_only(var):
        if var in from_inputs:
            return from_inputs[var]
        if var not in bound:
            from_inputs[var] = False
            return False
        from_inputs[var] = all(data_only(v) for v in relax.analysis.free_vars(bound[var]))
        return from_inputs[var]

    sites, names = [], []
    for var in order:
        value = bound[var]
        if (isinstance(value, relax.Call) and value.op.same_as(_TAKE)
                and isinstance(value.args[0], relax.Var) and value.args[0] in table_of):
            ids = value.args[1]
            if all(data_only(v) for v in relax.analysis.free_vars(ids)):
                sites.append(ids)
                names.append(table_of[value.args[0]])
    if not sites:
        return None, []
    needed = set()

    def need(expr):
        for v in relax.analysis.free_vars(expr):
            if v in bound and v not in needed:
                needed.add(v)
                need(bound[v])

    for ids in sites:
        need(ids)
    params = [relax.Var(v.name, v.ty) for v in inputs]
    mapping: Dict[relax.Var, relax.Expr] = dict(zip(inputs, params))
    bb = relax.BlockBuilder()
    with bb.function("lookup_ids", params):
        with bb.dataflow():
            for var in order:
                if var in needed:
                    mapping[var] = bb.emit(SubstituteVars(mapping).visit_expr(bound[var]))
            out = bb.emit_output(relax.Tuple([SubstituteVars(mapping).visit_expr(i)
                                              for i in sites]))
        bb.emit_func_output(out)
    return bb.get(), names
