"""Context parallelism as a rewrite of the forward graph, before autodiff (DESIGN.md section 1,
"Long sequences"): each of the cp ranks computes the forward on its share of the sequence.

``split_sequence(func, cp, method, num_inputs)`` follows the sequence split from the inputs
(axis 1 of each input whose axis 1 is the sequence, as the Trainer cuts them) through the
graph with the tensor-parallel pass's layouts (tp_layout.py: one rank digit, which follows
reshapes and transposes; here the digit is the cp rank and the split axis the sequence).
Rank r's tokens are those at ``cp_positions`` (ir/context_parallel.py): for the ring, chunks
r and 2cp-1-r of 2cp (load-balanced causal work, as torchtitan and Megatron's
context_parallel do), for all-to-all chunk r of cp. The Trainer lays them out contiguously,
so the split is a plain split in that order and every token-wise op (norms, MLPs, the
embedding lookup, the logits) runs unchanged on the local tokens.

What the rewrite changes:

- inputs split along axis 1, and every shape (reshape, broadcast_to) the local one;
- a value that does not follow the sequence but meets it at full length (a position
  embedding ``wpe[arange(T)]``, RoPE's cos / sin tables, a dropout mask drawn for the whole
  sequence) is cut to this rank's positions by ``take(x, cp_positions, axis)``: its
  gradient scatters back, so a learned position table's gradient is this rank's rows, and
  the gradient reduction over the dp x cp group assembles it;
- attention (the op of ir/attention.py) becomes ``cp_attention`` (ring or all-to-all), which
  sees every key of the sequence.

Each rank's loss is then the mean over its own tokens, so gradients average over the cp
ranks as they do over dp (equal tokens per rank), and the mean over the dp x cp group is
the unsplit run's. Whatever cannot follow the sequence is refused with the binding named
(``SequenceSplitError``): a reduction or softmax over the sequence outside attention, a
matmul contracting it, attention with a mask (only causal or none: the mask would have to
travel round the ring), a slice of the sequence axis, an output without it.

``LowerContextParallel(group)`` (after autodiff) makes the ops blocking host calls on the
cp group.
"""
import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import tvm
from tvm import relax

from ..ir.attention import has_mask
from ..ir.context_parallel import (CP_ATTENTION, CP_ATTENTION_BACKWARD_KERNEL,
                                   CP_ATTENTION_FORWARD_KERNEL, CP_ATTENTION_GRAD,
                                   CP_POSITIONS, CP_POSITIONS_FUNC, cp_attention, is_op,
                                   positions)
from ..ir.ops import ATTENTION, TP_COPY, TP_MAX, TP_RANK, TP_REDUCE
from ..ir.utils import op_name
from .bucketing import Segments, assemble, collective
from .gradient_markers import substitute
from .lower_allreduce import lower_functions
from .tp_layout import (PARTIAL, SplitRules, Unsplittable, dim_of, field_shapes,
                        hi_of, local_shape, static_shape)


class SequenceSplitError(ValueError):
    """The forward cannot be split along the sequence (the message names the binding)."""


@dataclasses.dataclass(frozen=True)
class SequencePlan:
    """What the rewrite found: the sequence length, the inputs it split (indices), the
    output's split (dimension, elements per segment), the attention calls (count)."""

    seq: int
    cp: int
    method: str
    split_inputs: Tuple[int, ...]
    output_dim: int
    output_size: int
    attentions: int


class _SequenceRules(SplitRules):
    """tp_layout's rules with the sequence as the split: a replicated value meeting it at
    full length is cut to this rank's positions (``slices``), never requested."""

    def __init__(self, cp: int, layouts: Dict[Any, Any]) -> None:
        super().__init__(cp, layouts, {}, set(), set(), set())
        self.slices: Dict[Any, List[Tuple[Any, int]]] = {}
        self.attentions: List[Any] = []
        self.current: Any = None

    def bind(self, binding: Any) -> None:
        self.current = binding.var
        super().bind(binding)
        if binding.var in self.partials:
            raise Unsplittable(binding.var, "a matmul contracts the sequence axis")

    def replicated_operand(self, var: Any, operand: Any, dim: Optional[int], size: int,
                           shape_dim: int) -> None:
        shape = static_shape(operand)
        if dim is None or dim < 0 or shape[dim] == 1:
            return
        if shape[dim] != shape_dim:
            raise Unsplittable(var, f"operand shapes {list(shape)} do not line up")
        if size != shape[dim]:
            raise Unsplittable(var, f"a {list(shape)} value meets the sequence flattened "
                                    "with another axis")
        self.slices.setdefault(var, []).append((operand, dim))

    def note_copy(self, operand: Any) -> None:  # no f: replicated values need no reduction
        return

    def rule(self, var: Any, call: Any) -> Any:
        name = op_name(call)
        if name in (TP_COPY, TP_REDUCE, TP_MAX):  # tensor parallelism's, token-wise
            return self.layouts[call.args[0]]
        if name == TP_RANK:  # a 0-d answer whatever its operand
            return None
        if name == "relax.take":
            return self.lookup(var, call)
        if name == ATTENTION:
            return self.attention(var, call)
        return super().rule(var, call)

    def lookup(self, var: Any, call: Any) -> Any:
        table, ids = call.args[0], call.args[1]
        if table in self.layouts:
            raise Unsplittable(var, "take from a value split along the sequence")
        if call.attrs.axis is None:
            raise Unsplittable(var, "take of flattened indices")
        axis = int(call.attrs.axis) % len(static_shape(table))
        j, size = self.split_dim(ids)
        return hi_of(static_shape(var), axis + j, size)

    def attention(self, var: Any, call: Any) -> Any:
        q, k, v, mask = call.args
        splits = [self.split_dim(a) if a in self.layouts else None for a in (q, k, v)]
        if any(s is None or s != (2, static_shape(a)[2]) for s, a in zip(splits, (q, k, v))):
            raise Unsplittable(var, "attention whose queries, keys and values do not all "
                                    "follow the sequence (cross-attention to another "
                                    "sequence is not split)")
        if has_mask(call):
            raise Unsplittable(var, "attention with a mask: context parallelism takes causal "
                                    "attention or none (a padding or custom mask would have "
                                    "to travel with the keys)")
        self.attentions.append(var)
        return tuple(hi_of(o, 2, static_shape(q)[2]) for o in field_shapes(var))


def sequence_inputs(func: relax.Function, num_inputs: int) -> Tuple[int, Tuple[int, ...]]:
    """(sequence length, indices of the inputs split along axis 1): the first input's axis 1
    is the sequence; every input whose axis 1 has that length follows it."""
    inputs = list(func.params[:num_inputs])
    first = static_shape(inputs[0]) if inputs else None
    if first is None or len(first) < 2:
        raise SequenceSplitError(
            "context parallelism splits axis 1 of the inputs (batch, sequence, ...), but the "
            f"first input has shape {list(first) if first else first}; feed (B, T) token ids "
            "or (B, T, d) features")
    seq = first[1]
    split = tuple(i for i, p in enumerate(inputs)
                  if (s := static_shape(p)) is not None and len(s) >= 2 and s[1] == seq)
    return seq, split


def in_words(why: str) -> str:
    """tp_layout's reason, with the split named as the sequence."""
    for old, new in (("tensor-parallel pass", "context-parallel pass"),
                     ("split dimension", "sequence axis")):
        why = why.replace(old, new)
    return why


def check_divides(seq: int, cp: int, method: str, source: str) -> None:
    """The sequence splits into the method's chunks (2cp for the ring, cp for all-to-all)."""
    parts = 2 * cp if method == "ring" else cp
    if seq % parts:
        what = (f"2 x context_parallel_size = {parts} chunks (the ring's load-balanced "
                "causal chunks)" if method == "ring" else f"context_parallel_size = {cp} chunks")
        fit = -(-seq // parts) * parts
        raise SequenceSplitError(
            f"{source}: a sequence of {seq} tokens does not split into {what}; pad the "
            f"sequence to a multiple of {parts} (e.g. {fit}), or choose a context_parallel_size "
            "that divides it")


def split_sequence(func: relax.Function, cp: int, method: str, num_inputs: int,
                   source: str = "the model") -> Tuple[relax.Function, SequencePlan]:
    """(``func`` as one cp rank computes it, the SequencePlan); raises SequenceSplitError
    naming the binding the split cannot pass."""
    if not any(op_name(b.value) == ATTENTION for block in func.body.blocks
               for b in block.bindings):
        raise SequenceSplitError(
            f"{source} has no attention over its sequence (F.scaled_dot_product_attention or "
            "a transformers attention): context parallelism splits attention's sequence over "
            "ranks, and this model would only repeat its work; use context_parallel_size=1 "
            "(or data parallelism)")
    seq, split = sequence_inputs(func, num_inputs)
    check_divides(seq, cp, method, source)
    layouts: Dict[Any, Any] = {}
    for i in split:
        p = func.params[i]
        layouts[p] = hi_of(static_shape(p), 1, seq)
    rules = _SequenceRules(cp, layouts)
    try:
        for block in func.body.blocks:
            for binding in block.bindings:
                rules.bind(binding)
    except Unsplittable as e:
        raise SequenceSplitError(
            f"{source}: context parallelism cannot split the sequence through {e.var.name}: "
            f"{in_words(e.why)}. Use "
            "context_parallel_size=1 for this model") from None
    if method == "alltoall":
        for var in rules.attentions:
            q, k = (static_shape(a) for a in rules.bound[var].args[:2])
            if q[1] % cp or k[1] % cp:
                raise SequenceSplitError(
                    f"{source}: context_parallel_method='alltoall' gives each of the "
                    f"{cp} ranks 1/{cp} of the heads, but {var.name} has {q[1]} query and "
                    f"{k[1]} key/value heads; use context_parallel_method='ring', or a "
                    f"context_parallel_size dividing both")
    out = func.body.body
    first = out.fields[0] if isinstance(out, relax.Tuple) else out
    for var in relax.analysis.free_vars(out):
        if var in layouts and not var.same_as(first):
            raise SequenceSplitError(f"{source}: {var.name}, an output besides the first, "
                                     "follows the sequence")
    if first not in layouts or isinstance(layouts[first], tuple):
        raise SequenceSplitError(
            f"{source}: its output does not keep the sequence axis (a reduction over the "
            "tokens, e.g. pooling for classification): context parallelism trains models "
            "whose output is per token (language models); use context_parallel_size=1")
    out_dim, out_size = dim_of(static_shape(first), layouts[first], cp)
    new = _rewrite(func, cp, method, seq, layouts, rules, split)
    return new, SequencePlan(seq, cp, method, split, out_dim, out_size,
                             len(rules.attentions))


def _rewrite(func: relax.Function, cp: int, method: str, seq: int, layouts: Dict[Any, Any],
             rules: _SequenceRules, split: Tuple[int, ...]) -> relax.Function:
    var_map: Dict[Any, Any] = {}
    params = []
    for p in func.params:
        if p in layouts:
            var_map[p] = relax.Var(p.name, relax.TensorType(
                local_shape(static_shape(p), layouts[p], cp), p.ty.dtype))
        params.append(var_map.get(p, p))
    attrs = dict(func.attrs) if func.attrs is not None else {}
    name = str(attrs.pop("global_symbol", "forward"))
    bb = relax.BlockBuilder()
    slot: Dict[str, Any] = {}
    like = var_map[func.params[split[0]]]

    def where() -> Any:  # this rank's positions, once per block that needs them
        if "positions" not in slot:
            slot["positions"] = bb.emit(positions(like, seq, cp, method == "ring"),
                                        name_hint="cp_positions")
        return slot["positions"]

    def emit(binding: Any, output: bool) -> None:
        var, value = binding.var, binding.value
        hi = layouts.get(var)
        cut = {operand: dim for operand, dim in rules.slices.get(var, [])}
        if var in rules.attentions:
            q, k, v = (substitute(a, var_map) for a in value.args[:3])
            new: Any = cp_attention(q, k, v, bool(int(value.attrs["causal"])),
                                    _scale(value), method, cp)
        elif isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            args = []
            for a in value.args:
                if a in cut:
                    args.append(bb.emit(relax.op.take(substitute(a, var_map), where(),
                                                      axis=cut[a]),
                                        name_hint=f"{getattr(a, 'name', 'c')}_mine"))
                else:
                    args.append(substitute(a, var_map))
            new = _local_call(value, args, var, hi, cp)
        else:
            new = substitute(value, var_map)
        emitted = (bb.emit_output(new, name_hint=var.name) if output
                   else bb.emit(new, name_hint=var.name))
        if hi is not None and not isinstance(hi, tuple):
            expected = local_shape(static_shape(var), hi, cp)
            if tuple(static_shape(emitted) or ()) != tuple(expected):
                raise AssertionError(f"context parallel rewrite of {var.name}: local shape "
                                     f"{static_shape(emitted)}, expected {expected}")
        var_map[var] = emitted

    with bb.function(name, params, attrs=attrs, pure=True):
        for block in func.body.blocks:
            slot.clear()
            if isinstance(block, relax.DataflowBlock):
                with bb.dataflow():
                    for b in block.bindings:
                        emit(b, output=not isinstance(b.var, relax.DataflowVar))
            else:
                for b in block.bindings:
                    emit(b, output=False)
        bb.emit_func_output(substitute(func.body.body, var_map))
    return bb.get()[name]


def _scale(call: relax.Call) -> float:
    scale = float(call.attrs["scale"])
    return scale if scale else 1.0 / math.sqrt(static_shape(call.args[0])[-1])


def _local_call(call: relax.Call, args: List[Any], var: Any, hi: Any, cp: int) -> relax.Call:
    if hi is None or hi == PARTIAL or isinstance(hi, tuple):
        return relax.Call(call.op, args, call.attrs, call.ty_args)
    if call.op.name in ("relax.reshape", "relax.broadcast_to"):
        shape = local_shape(static_shape(var), hi, cp)
        return relax.Call(call.op, [args[0], relax.ShapeExpr(list(shape))], call.attrs,
                          call.ty_args)
    return relax.Call(call.op, args, call.attrs, call.ty_args)


# ---- lowering -------------------------------------------------------------------------------
def _lower(func: relax.Function, group: int) -> relax.Function:
    """cp_positions -> a pure runtime call; cp_attention and its gradient -> blocking impure
    host calls writing outputs allocated before them (as passes/lower_allreduce.py's
    collectives)."""
    seg = Segments()
    found = False
    for block in func.body.blocks:
        dataflow = isinstance(block, relax.DataflowBlock)
        for binding in block.bindings:
            value = binding.value
            if is_op(value, CP_POSITIONS):
                found = True
                ty = binding.var.ty
                seg.add(relax.VarBinding(binding.var, relax.call_pure_packed(
                    CP_POSITIONS_FUNC, value.args[0], relax.prim_value(group),
                    relax.prim_value(int(value.attrs["seq"])),
                    relax.prim_value(int(value.attrs["balanced"])), ty_args=ty)), dataflow)
                continue
            kernel = (CP_ATTENTION_FORWARD_KERNEL if is_op(value, CP_ATTENTION) else
                      CP_ATTENTION_BACKWARD_KERNEL if is_op(value, CP_ATTENTION_GRAD) else None)
            if kernel is None:
                seg.add(binding, dataflow)
                continue
            found = True
            outs = []
            for i, field in enumerate(binding.var.ty.fields):
                outs.append(seg.bind(f"{binding.var.name}_{i}", relax.op.builtin.alloc_tensor(
                    relax.ShapeExpr([int(d) for d in field.shape]), str(field.dtype),
                    relax.prim_value(0)), dataflow=False))
            attrs = value.attrs
            seg.bind(f"{binding.var.name}_cp", collective(
                kernel, *value.args, relax.prim_value(int(attrs["causal"])),
                relax.prim_value(tvm.tirx.FloatImm("float64", float(attrs["scale"]))),
                relax.prim_value(int(str(attrs["method"]) == "alltoall")),
                relax.prim_value(group), *outs), dataflow=False)
            seg.add(relax.VarBinding(binding.var, relax.Tuple(outs)), dataflow)
    if not found:
        return func
    return assemble(func, seg.segments, func.body.body)


@tvm.transform.module_pass(opt_level=0, name="LowerContextParallel")
class LowerContextParallel:
    """After autodiff: the cp ops on native process group ``group`` (the cp axis of the
    mesh; the same id on every rank, so the IR stays SPMD)."""

    def __init__(self, group: int) -> None:
        self.group = int(group)

    def transform_module(self, mod: Any, ctx: Any) -> Any:
        return lower_functions(mod, lambda func: _lower(func, self.group))
