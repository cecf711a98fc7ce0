"""WidenAtUse: a float32 value that is only a 16-bit value widened is not kept; each of its
readers widens the 16-bit value itself.

Input: a module before LegalizeOps (a training step after the distribution passes). Output:
every ``v = astype(u, "float32")`` of a bfloat16 / float16 ``u`` whose readers are all
operators TVM fuses a cast into (elementwise, broadcast, reshape, reductions: ``_FUSES``)
in the same dataflow block is dropped; each reader reads its own ``astype(u, "float32")``
emitted just before it.

Why: under mixed precision each weight's gradient leaves its GEMM in 16 bits and is widened
to float32 for the optimizer (master weights and states are float32), and the widened
gradients are all alive from the backward to the update — the non-finite guard reads every
gradient before any parameter is updated. On GPT-2 124M in bf16 that is 340 MB of float32
gradients at the backward's end, twice the 16-bit ones. Read through a cast fused into each
reader (the guard's sum, Adam's moment updates), only the 16-bit gradients are kept. Widening
is exact, so every reader computes the same values as before; the cast runs once per reader
instead of once, inside the readers' own loops (for bf16 a load and a shift).

Not rewritten: a widened value read by a collective, a BLAS call, a packed function, a
match_cast, the function's result or another block (the gradients bucketed for data
parallelism or ZeRO keep their float32 buckets). (A reader that narrows the value again
is a fused cast like the others.) The pass first canonicalizes the bindings (``w = v``
aliases), so that an alias's readers count as the value's. Megatron-LM and DeepSpeed keep float32 ``main_grad``
buffers instead, which this does not need: without microbatches the 16-bit gradient is the
value (with them, the float32 accumulators are the step's arguments and stay as they are).
"""
from typing import Dict, List

import tvm
from tvm import relax

from ..ir.utils import op_name
from .auto_cast import LOW_DTYPES

#: readers TVM's FuseOps fuses an elementwise cast into (elementwise / broadcast / injective
#: / reduction operators)
_FUSES = frozenset("relax." + name for name in (
    "add", "subtract", "multiply", "divide", "where", "sqrt", "rsqrt", "power", "maximum",
    "minimum", "isfinite", "abs", "negative", "square", "reshape", "sum", "max", "min",
    "greater", "greater_equal", "less", "less_equal", "equal", "not_equal", "clip", "astype"))


def _widenings(block: relax.DataflowBlock, readers: Dict[relax.Var, List[relax.Expr]]
               ) -> Dict[relax.Var, relax.Var]:
    """{v: u} for the block's ``v = astype(u, float32)`` whose every reader fuses a cast."""
    out = {}
    for binding in block.bindings:
        value = binding.value
        if not isinstance(binding, relax.VarBinding) or op_name(value) != "relax.astype" \
                or not isinstance(binding.var, relax.DataflowVar):
            continue
        source = value.args[0]
        if not isinstance(source, relax.Var) or str(binding.var.ty.dtype) != "float32" \
                or str(getattr(source.ty, "dtype", "")) not in LOW_DTYPES:
            continue
        users = readers.get(binding.var, [])
        if users and all(op_name(u) in _FUSES for u in users):
            out[binding.var] = source
    return out


def _readers(func: relax.Function) -> Dict[relax.Var, List[relax.Expr]]:
    """{var: [the binding values reading it]}; a read anywhere else (a nested expression,
    a block's or the function's result, a tuple) is recorded as None, which fuses nothing."""
    out: Dict[relax.Var, List[relax.Expr]] = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call) \
                    and isinstance(value.op, tvm.ir.Op) and not value.ty_args:
                for arg in value.args:
                    if isinstance(arg, relax.Var):
                        out.setdefault(arg, []).append(value)
                    else:
                        for var in relax.analysis.free_vars(arg):
                            out.setdefault(var, []).append(None)
            else:
                for var in relax.analysis.free_vars(value):
                    out.setdefault(var, []).append(None)
    for var in relax.analysis.free_vars(func.body.body):
        out.setdefault(var, []).append(None)
    return out


def widen_at_use(func: relax.Function) -> relax.Function:
    """``func`` with its fusable widenings read at each use (module docstring)."""
    if not isinstance(func.body, relax.SeqExpr):
        return func
    readers = _readers(func)
    blocks, changed = [], False
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            blocks.append(block)
            continue
        widened = _widenings(block, readers)
        if not widened:
            blocks.append(block)
            continue
        changed = True
        out = []
        for binding in block.bindings:
            if binding.var in widened:
                continue  # each reader widens for itself
            value = binding.value
            if isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call) \
                    and any(isinstance(a, relax.Var) and a in widened for a in value.args):
                args, fresh = [], {}
                for arg in value.args:
                    if isinstance(arg, relax.Var) and arg in widened:
                        if arg not in fresh:  # multiply(g, g): one cast
                            fresh[arg] = relax.DataflowVar(f"{arg.name}_at_use", arg.ty)
                            out.append(relax.VarBinding(fresh[arg], relax.op.astype(
                                widened[arg], "float32")))
                        arg = fresh[arg]
                    args.append(arg)
                value = relax.Call(value.op, args, value.attrs, value.ty_args)
                binding = relax.VarBinding(binding.var, value)
            out.append(binding)
        blocks.append(relax.DataflowBlock(out))
    if not changed:
        return func
    body = relax.SeqExpr(blocks, func.body.body)
    new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
    return relax.BlockBuilder().normalize(new)


@tvm.transform.module_pass(opt_level=0, name="WidenAtUse")
class WidenAtUse:
    """See the module docstring."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        mod = relax.transform.CanonicalizeBindings()(mod)  # readers through ``w = v`` aliases
        builder = relax.BlockBuilder(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                new = widen_at_use(func)
                if not new.same_as(func):
                    builder.update_func(gvar, new)
        return builder.get()
