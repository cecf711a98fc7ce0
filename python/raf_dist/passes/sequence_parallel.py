"""Sequence parallelism as a rewrite of the tensor-parallel forward, before autodiff (Megatron-LM,
Korthikanti et al. 2022; DESIGN.md section 1, "Long sequences"): the regions between the
tensor-parallel blocks hold 1/tp of the sequence.

Input: the forward as tp_shard.py wrote it (and, with context parallelism, as
context_parallel.py cut it), whose tensor-parallel blocks begin with f (``tp_copy``) and end
with g (``tp_reduce``). ``split_between_blocks(func, tp)``:

- each g becomes a reduce-scatter along the sequence (axis 1 of its (B, T, ...) partial
  sum): this rank's tokens of the sum, ``sp_reduce_scatter``;
- from there the split follows the token-wise ops (residual adds, norms, dropout, the row
  layer's bias) with tp_layout's rules (the digit is the tp rank, the axis the sequence);
- each f whose value is split becomes an all-gather (``sp_all_gather``, its gradient a
  reduce-scatter: the block's ranks hold partial gradients);
- a value every rank holds whole that meets the split at full length (the residual from
  before the first block, a position table, a dropout mask) is cut to this rank's tokens
  (``sp_split``, gradient all-gather); one broadcast along the sequence (a norm's weight,
  a bias) or a weight read by a split matmul is wrapped in f: each rank's gradient of it is
  its tokens' share, summed over the tp ranks by f's backward (Megatron all-reduces the
  sequence-parallel parameters' gradients the same way);
- a split value leaving the forward is gathered (``sp_all_gather`` without reduce: every
  rank's loss sees the whole output).

Between the blocks each rank then holds (B, T/tp, d) instead of (B, T, d), and the 2(tp-1)/tp
bytes of each allreduce travel as a reduce-scatter and an all-gather of (tp-1)/tp each: the
same bytes, the activations of those regions divided by tp. Refused (``SequenceSplitError``,
naming the binding): attention or a reduction over the sequence between the blocks, an
activation without a (B, T, ...) sequence axis at a block's end, a sequence tp does not
divide. ``LowerSequenceParallel(group)`` (after autodiff) makes the ops host calls on the tp
group.
"""
from typing import Any, Dict, List, Tuple

import numpy as np
import tvm
from tvm import relax

from ..ir import sequence_parallel as sp
from ..ir.ops import ATTENTION, TP_COPY, TP_MAX, TP_RANK, TP_REDUCE, tp_copy
from ..ir.utils import op_name
from .bucketing import collective
from .context_parallel import SequenceSplitError, in_words
from .gradient_markers import substitute
from .lower_allreduce import lower_blocking, lower_functions
from .tp_layout import SplitRules, Unsplittable, dim_of, local_shape, static_shape



#: ops that only view their operand (what the importer wraps a matmul's input in)
_VIEWS = ("relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze",
          "relax.broadcast_to")


class _BetweenBlocks(SplitRules):
    """tp_layout's rules from each g on: replicated operands are cut or wrapped in f, never
    requested; f of a split value gathers it."""

    def __init__(self, tp: int, layouts: Dict[Any, Any], rows: int, seq: int) -> None:
        super().__init__(tp, layouts, {}, set(), set(), set())
        self.rows, self.seq = rows, seq  # the batch and its tokens (the first input's)
        self.scatters: List[Any] = []  # g's bindings, now reduce-scatters
        self.gathers: List[Any] = []  # f's bindings of a split value
        self.slices: Dict[Any, List[Tuple[Any, int]]] = {}
        self.wrapped: Dict[Any, List[Any]] = {}  # binding -> operands wrapped in f
        self.current: Any = None

    def bind(self, binding: Any) -> None:
        var, value = binding.var, binding.value
        self.current = var
        name = op_name(value)
        if name == TP_REDUCE and value.args[0] not in self.layouts:
            shape = static_shape(var)
            numel = int(np.prod(shape)) if shape else 0
            hi = numel // self.rows if numel % (self.rows * self.seq) == 0 else None
            if not shape or hi is None or dim_of(shape, hi, self.tp) is None:
                raise Unsplittable(var, f"a block ends in a value of shape "
                                        f"{list(shape) if shape else shape}, which is not "
                                        f"(batch {self.rows}, its {self.seq} tokens "
                                        f"{'' if self.seq % self.tp else 'in ' + str(self.tp)} "
                                        "..., features)")
            self.bound[var] = value
            self.layouts[var] = hi
            self.scatters.append(var)
            return
        if name == TP_COPY and value.args[0] in self.layouts:
            self.bound[var] = value
            if self.layouts[value.args[0]] * self.rows != int(np.prod(static_shape(
                    value.args[0]))):
                raise Unsplittable(var, "a block reads a value split along another axis")
            self.gathers.append(var)
            return
        super().bind(binding)
        if var in self.partials:
            raise Unsplittable(var, "a matmul contracts the sequence axis")

    def replicated_operand(self, var: Any, operand: Any, dim: Any, size: int,
                           shape_dim: int) -> None:
        shape = static_shape(operand)
        if dim is None or dim < 0 or shape[dim] == 1:
            self.note_copy(operand)
            return
        if shape[dim] != shape_dim:
            raise Unsplittable(var, f"a {list(shape)} value meets the sequence axis "
                                    "broadcast")
        outer = int(np.prod(shape[:dim])) * (shape[dim] // size)  # its (outer, n, inner)
        self.slices.setdefault(var, []).append((operand, outer))

    def note_copy(self, operand: Any) -> None:
        if isinstance(operand, relax.Var) and operand not in self.layouts:
            self.wrapped.setdefault(self.current, []).append(operand)

    def rule(self, var: Any, call: Any) -> Any:
        name = op_name(call)
        if name in (TP_MAX,):
            return self.layouts[call.args[0]]
        if name == TP_RANK:
            return None
        if name == ATTENTION:
            raise Unsplittable(var, "attention between the tensor-parallel blocks (its heads "
                                    "are not split over tp)")
        return super().rule(var, call)


def split_between_blocks(func: relax.Function, tp: int,
                         source: str = "the model") -> relax.Function:
    """``func`` with the regions between its tensor-parallel blocks split along the sequence
    (module docstring); its first input is (batch, sequence, ...)."""
    first = static_shape(func.params[0])
    if first is None or len(first) < 2:
        raise SequenceSplitError(f"{source}: sequence_parallel splits axis 1 of the inputs "
                                 f"(batch, sequence, ...); the first input has shape {first}")
    if first[1] % tp:
        raise SequenceSplitError(
            f"{source}: sequence_parallel splits the sequence over the {tp} tensor-parallel "
            f"ranks, and {tp} does not divide its {first[1]} tokens (per context-parallel "
            "rank with context parallelism); pad the sequence to a multiple, or set "
            "sequence_parallel = False")
    layouts: Dict[Any, Any] = {}
    rules = _BetweenBlocks(tp, layouts, first[0], first[1])
    try:
        for block in func.body.blocks:
            for binding in block.bindings:
                rules.bind(binding)
    except Unsplittable as e:
        raise SequenceSplitError(
            f"{source}: sequence_parallel cannot split the sequence between the "
            f"tensor-parallel blocks at {e.var.name}: {in_words(e.why)}. Set "
            "sequence_parallel = False for this model") from None
    if not rules.scatters:
        raise SequenceSplitError(
            f"{source}: sequence_parallel splits the regions between tensor-parallel blocks, "
            "but the tensor-parallel plan splits no block of this model (no row-parallel "
            "layer); set sequence_parallel = False")
    return _rewrite(func, tp, layouts, rules, first[0])


def _rewrite(func: relax.Function, tp: int, layouts: Dict[Any, Any],
             rules: _BetweenBlocks, rows: int) -> relax.Function:
    var_map: Dict[Any, Any] = {}
    attrs = dict(func.attrs) if func.attrs is not None else {}
    name = str(attrs.pop("global_symbol", "forward"))
    bb = relax.BlockBuilder()
    copies: Dict[Any, Any] = {}
    scatters, gathers = set(rules.scatters), set(rules.gathers)

    def copied(operand: Any) -> Any:
        if operand not in copies:
            copies[operand] = bb.emit(tp_copy(substitute(operand, var_map)),
                                      name_hint=f"{operand.name}_sp")
        return copies[operand]

    def emit(binding: Any, output: bool) -> None:
        var, value = binding.var, binding.value
        hi = layouts.get(var)
        if var in scatters:
            new: Any = sp.reduce_scatter(substitute(value.args[0], var_map), rows, tp)
        elif var in gathers:
            new = sp.all_gather(substitute(value.args[0], var_map), rows, tp, True)
        elif isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            cut = {operand: outer for operand, outer in rules.slices.get(var, [])}
            wrap = set(rules.wrapped.get(var, []))
            args = []
            for a in value.args:
                if a in cut:
                    args.append(bb.emit(sp.split(substitute(a, var_map), cut[a], tp),
                                        name_hint=f"{getattr(a, 'name', 'c')}_sp"))
                elif a in wrap:
                    args.append(copied(a))
                else:
                    args.append(substitute(a, var_map))
            if hi is not None and not isinstance(hi, tuple) and value.op.name in (
                    "relax.reshape", "relax.broadcast_to"):
                args = [args[0], relax.ShapeExpr(list(local_shape(static_shape(var), hi, tp)))]
            new = relax.Call(value.op, args, value.attrs, value.ty_args)
        else:
            new = substitute(value, var_map)
        emitted = (bb.emit_output(new, name_hint=var.name) if output
                   else bb.emit(new, name_hint=var.name))
        if hi is not None and not isinstance(hi, tuple):
            expected = local_shape(static_shape(var), hi, tp)
            if tuple(static_shape(emitted) or ()) != tuple(expected):
                raise AssertionError(f"sequence parallel rewrite of {var.name}: local shape "
                                     f"{static_shape(emitted)}, expected {expected}")
        var_map[var] = emitted

    out = func.body.body
    first = out.fields[0] if isinstance(out, relax.Tuple) else out
    with bb.function(name, list(func.params), attrs=attrs, pure=True):
        for block in func.body.blocks:
            copies.clear()
            dataflow = isinstance(block, relax.DataflowBlock)
            if dataflow:
                with bb.dataflow():
                    for b in block.bindings:
                        emit(b, output=not isinstance(b.var, relax.DataflowVar))
                    if first in layouts and any(b.var.same_as(first) for b in block.bindings):
                        var_map[first] = bb.emit_output(sp.all_gather(
                            var_map[first], _output_rows(first, layouts, rows), tp, False),
                            name_hint=f"{first.name}_whole")
            else:
                for b in block.bindings:
                    emit(b, output=False)
        bb.emit_func_output(substitute(out, var_map))
    return bb.get()[name]


def _output_rows(var: Any, layouts: Dict[Any, Any], rows: int) -> int:
    if isinstance(layouts[var], tuple) or layouts[var] * rows != int(np.prod(static_shape(var))):
        raise SequenceSplitError(f"{var.name}: the forward's output is split along another "
                                 "axis than the sequence")
    return rows


# ---- the backward gathers again ---------------------------------------------------------------
def regather_in_backward(adjoint: relax.Function, n_forward: int) -> relax.Function:
    """``adjoint`` (TVM's Gradient output, one dataflow block: ``n_forward`` forward bindings,
    then the backward) with every backward use of a block's all-gathered input (the f of
    sequence parallelism: the column-parallel matmul's weight gradient reads it) replaced by
    an all-gather of its sharded input again, emitted before the first such use, as
    Megatron's sequence parallelism does: the step keeps each rank's (B, T/tp, d) through
    the forward instead of the whole (B, T, d), for one more all-gather per block in the
    backward. A no-op without sequence parallelism."""
    if len(adjoint.body.blocks) != 1:
        return adjoint
    bindings = list(adjoint.body.blocks[0].bindings)
    producer = {b.var: b.value for b in bindings[:n_forward]}
    again: Dict[Any, Any] = {}  # forward value -> its copy in the backward
    out = list(bindings[:n_forward])

    def chain(var: Any) -> bool:
        """A block's all-gathered input, or a view of one (the importer's reshapes)."""
        value = producer.get(var)
        if value is None:
            return False
        if sp.kind_of(value) == 1:
            return bool(int(value.attrs["reduce"]))
        return op_name(value) in _VIEWS and chain(value.args[0])

    def copy(var: Any) -> Any:
        if var not in again:
            value = producer[var]
            if sp.kind_of(value) != 1:  # a view: of the copy of what it views
                value = relax.Call(value.op, [copy(value.args[0]), *value.args[1:]],
                                   value.attrs, value.ty_args)
            again[var] = relax.DataflowVar(f"{var.name}_again", var.ty)
            out.append(relax.VarBinding(again[var], value))
        return again[var]

    if not any(chain(b.var) for b in bindings[:n_forward]):
        return adjoint
    for binding in bindings[n_forward:]:
        used = {v: copy(v) for v in relax.analysis.free_vars(binding.value) if chain(v)}
        if used:
            binding = relax.VarBinding(binding.var, substitute(binding.value, used))
        out.append(binding)
    body = relax.SeqExpr([relax.DataflowBlock(out)], adjoint.body.body)
    func = relax.Function(adjoint.params, body, adjoint.ret_ty, adjoint.is_pure, adjoint.attrs)
    return relax.BlockBuilder().normalize(func)


# ---- lowering -------------------------------------------------------------------------------
def _lower(func: relax.Function, group: int) -> relax.Function:
    """Each sp op a blocking host call filling its output (lower_blocking, as every raf_dist
    collective op is lowered)."""
    def call(value: relax.Call, out: relax.Var) -> relax.Call:
        return collective(sp.SP_KERNEL, value.args[0], relax.prim_value(sp.kind_of(value)),
                          relax.prim_value(int(value.attrs["outer"])), relax.prim_value(group),
                          out)

    return lower_blocking(func, lambda value: sp.kind_of(value) >= 0, call, "sp")


@tvm.transform.module_pass(opt_level=0, name="LowerSequenceParallel")
class LowerSequenceParallel:
    """After autodiff: the sequence-parallel ops on native process group ``group`` (the tp
    axis of the mesh)."""

    def __init__(self, group: int) -> None:
        self.group = int(group)

    def transform_module(self, mod: Any, ctx: Any) -> Any:
        return lower_functions(mod, lambda func: _lower(func, self.group))
