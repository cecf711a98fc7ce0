"""UpdateInPlace: the step writes the new parameters and optimizer state into the buffers it
was given (as torch.optim does), so a step holds one copy of them, not two.

Runs after CallTIRRewrite (and WriteGradientsIntoBuckets) and before StaticPlanBlockMemory, on
functions with the ``raf_dist.updated_arguments`` attribute (``build_train_step`` sets it,
ShardZeRO rewrites it): output field 1 + i is the new value of argument
``updated_arguments[i]``. For each such output that is not the argument itself already
(ShardZeRO's allgather writes the updated parameters into their arguments):
  - trace it through aliases and tuple items to the ``R.builtin.alloc_tensor`` its kernel
    writes into (CallTIRRewrite's output allocation), and find that kernel (the first call
    taking the allocation);
  - the allocation becomes ``alloc = argument``: the kernel writes the new value into the
    argument's buffer, the planner no longer allocates it and the function returns the
    argument itself.
It is done only when it is safe; otherwise the output keeps its allocation and the reason is
logged (``logging.getLogger("raf_dist")``):
  - nothing reads the argument (or an alias, view or tuple holding it) after the kernel: no
    later kernel, no collective wait (an asynchronous collective's wait names its buffers,
    DESIGN.md section 5, so a collective still reading the argument counts as a later read);
  - the kernel itself reads the argument only as an elementwise update: a generated kernel
    (PrimFunc) in which the single block writing the output is data-parallel and reads the
    argument at exactly the element it writes, and no other block reads the argument. A
    library call (BLAS, a runtime builtin) that reads the argument is never made in place.
The kernel then runs on a copy of its PrimFunc without the ``noalias`` attribute, because its
input and output buffers now alias; no other code changes.
"""
import logging

import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import Schedule

from ..ir.attrs import UPDATED_ARGUMENTS
from ..ir.ops import EMBEDDING_ROW_UPDATES
from ..ir.utils import is_packed_marker
from .inplace_buckets import LoweredFunction, is_static_tensor

logger = logging.getLogger("raf_dist")

_ALLOC_TENSOR = tvm.ir.Op.get("relax.builtin.alloc_tensor")
_NOALIAS = ("tirx.noalias", "tir.noalias")


def _aliases(info, var):
    """``var`` and every variable bound to a value that may hold or view its memory (aliases,
    reshapes, views, tuples, tuple items): anything but a kernel's void result or a fresh
    allocation."""
    found = {var}
    for binding in info.bindings:
        value = binding.value
        if isinstance(value, relax.Call) and value.op == _ALLOC_TENSOR:
            continue
        if isinstance(binding.var.ty, relax.TupleType) and not binding.var.ty.fields:
            continue  # a call's void result
        if any(v in found for v in relax.analysis.free_vars(value)):
            found.add(binding.var)
    return found


def _allocation(info, out):
    """The alloc_tensor binding var ``out`` is computed into, through aliases and tuple
    items, or None."""
    var = out
    while True:
        value = info.value.get(var)
        if isinstance(value, relax.Var):
            var = value
        elif isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            fields = info.value.get(value.tuple_value)
            if not isinstance(fields, relax.Tuple):
                return None
            var = fields.fields[value.index]
            if not isinstance(var, relax.Var):
                return None
        else:
            break
    value = info.value.get(var)
    if isinstance(value, relax.Call) and value.op == _ALLOC_TENSOR:
        return var
    return None


def _is_argument(info, field, argument):
    """Whether output ``field`` is ``argument`` itself (through variable aliases): its new
    value was written into the argument's buffer by a call that names it (a collective)."""
    while isinstance(field, relax.Var) and isinstance(info.value.get(field), relax.Var):
        field = info.value[field]
    value = info.value.get(field) if isinstance(field, relax.Var) else None
    if any(is_packed_marker(value, f) for f in EMBEDDING_ROW_UPDATES):  # a sparse table
        return _is_argument(info, value.args[1], argument)  # update: its first argument
    if (isinstance(value, relax.Call) and isinstance(value.op, relax.ExternFunc)
            and value.op.global_symbol in EMBEDDING_ROW_UPDATES):  # the same, lowered
        return _is_argument(info, value.args[0], argument)
    return isinstance(field, relax.Var) and field.same_as(argument)


def _blocks(sch, block):
    for child in sch.get_child_blocks(block):
        yield sch.get(child)
        yield from _blocks(sch, child)


def elementwise_update(prim_func: tvm.tirx.PrimFunc, read_positions: list,
                       write_position: int):
    """Why the kernel ``prim_func`` may NOT write its parameter ``write_position`` into the
    buffer of its parameters ``read_positions`` (None when it may): the one block writing it
    must be data-parallel and read those buffers at exactly the element it writes, no other
    block may read them, and every buffer a block touches must be a kernel parameter or a
    buffer the kernel allocates (no view that could alias them unseen)."""
    params = list(prim_func.params)
    out = params[write_position]
    inputs = [params[p] for p in read_positions]
    try:
        sch = Schedule(prim_func)
        blocks = list(_blocks(sch, sch.get_sblock("root")))
    # ScheduleError (a RuntimeError) when the kernel has no block structure to read: then
    # nothing can be proved and the output keeps its own buffer
    except (RuntimeError, ValueError) as error:
        return f"its blocks cannot be read ({str(error).strip().splitlines()[-1]})"
    own = [b for block in blocks for b in block.alloc_buffers]

    def is_(source, candidates):
        return any(source.same_as(c) for c in candidates)

    writers = [b for b in blocks if any(is_(w.source, [out]) for w in b.writes)]
    if len(writers) != 1:
        return f"{len(writers)} blocks write the output"
    writer = writers[0]
    for block in blocks:
        if block.match_buffers:
            return f"block {block.name_hint!r} matches a sub-buffer"
        for region in list(block.reads) + list(block.writes):
            if not is_(region.source, params + own):
                return f"block {block.name_hint!r} touches a buffer that is not a parameter"
        if not block.same_as(writer) and any(is_(r.source, inputs) for r in block.reads):
            return f"block {block.name_hint!r} reads the argument but does not write the output"
    if any(iv.iter_type != tvm.tirx.IterVar.DataPar for iv in writer.iter_vars):
        return f"block {writer.name_hint!r} is not data-parallel"
    region = [w.region for w in writer.writes if is_(w.source, [out])][0]
    for read in writer.reads:
        if is_(read.source, [out]):
            return f"block {writer.name_hint!r} reads its own output"
        if is_(read.source, inputs) and not tvm_ffi.structural_equal(read.region, region):
            return f"block {writer.name_hint!r} reads the argument at other elements than it writes"
    return None


def _writer(info, alloc):
    """Position of the first binding that takes ``alloc`` as an argument (its kernel)."""
    for position in range(info.position[alloc] + 1, len(info.bindings)):
        value = info.bindings[position].value
        if isinstance(value, relax.Call) and any(a.same_as(alloc) for a in value.args):
            return position
    return None


def _rewrite(builder, mod, func, name):
    updated = [int(i) for i in func.attrs[UPDATED_ARGUMENTS]]
    info = LoweredFunction(func)
    result = func.body.body
    while isinstance(info.value.get(result), relax.Var):
        result = info.value[result]
    fields = info.value.get(result)
    if not isinstance(fields, relax.Tuple) or len(fields.fields) != 1 + len(updated):
        raise ValueError(f"UpdateInPlace: {name} must return (loss, *updated arguments) as "
                         f"its {UPDATED_ARGUMENTS} attribute says ({len(updated)} arguments)")
    last_use = len(info.bindings)  # the return counts as a use
    replace, variants, claimed = {}, {}, set()
    for field, index in zip(fields.fields[1:], updated):
        argument = func.params[index]

        def refuse(reason):
            logger.warning("UpdateInPlace: %s: %s gets a new buffer each step (one more copy "
                           "in the planned memory): %s", name, argument.name, reason)

        if _is_argument(info, field, argument):
            continue  # already written in place (ShardZeRO's allgather into the parameters)
        if is_static_tensor(argument.ty) and any(int(d) == 0 for d in argument.ty.shape):
            continue  # no element to copy (a table another rank holds: embedding_parallel)
        alloc = _allocation(info, field) if isinstance(field, relax.Var) else None
        if alloc is None:
            refuse("its new value is not computed into an allocation of its own")
            continue
        if alloc in claimed:
            refuse("its new value is the same tensor as another argument's")
            continue
        if not (is_static_tensor(alloc.ty) and is_static_tensor(argument.ty)
                and [int(d) for d in alloc.ty.shape] == [int(d) for d in argument.ty.shape]
                and str(alloc.ty.dtype) == str(argument.ty.dtype)):
            refuse(f"its new value is {alloc.ty}, not {argument.ty}")
            continue
        writer = _writer(info, alloc)
        if writer is None:
            refuse("no kernel writes its new value")
            continue
        aliases = _aliases(info, argument)
        late = [p for v in aliases for p in info.uses.get(v, []) if p > writer]
        if late:
            at = min(late)
            what = "the function's result" if at == last_use else info.bindings[at].var.name
            refuse(f"{what} reads it after its update")
            continue
        call = info.bindings[writer].value
        reads = [k for k, a in enumerate(call.args) if isinstance(a, relax.Var) and a in aliases]
        if reads:
            kernel = mod[call.op] if isinstance(call.op, tvm.ir.GlobalVar) else None
            if not isinstance(kernel, tvm.tirx.PrimFunc):
                refuse("a library call reads it while computing its new value")
                continue
            out_position = next(k for k, a in enumerate(call.args) if a.same_as(alloc))
            why = elementwise_update(kernel, reads, out_position)
            if why is not None:
                refuse(f"kernel {call.op.name_hint}: {why}")
                continue
            variants[writer] = call.op
        claimed.add(alloc)
        replace[info.position[alloc]] = argument
    if not replace:
        return func

    new_kernels = {}  # kernel name -> GlobalVar of its copy without noalias
    for gvar in variants.values():
        if gvar.name_hint not in new_kernels:
            kernel = mod[gvar]
            for key in _NOALIAS:
                if kernel.attrs is not None and key in kernel.attrs:
                    kernel = kernel.without_attr(key)
            new_kernels[gvar.name_hint] = builder.add_func(kernel, f"{gvar.name_hint}_inplace")
    blocks, position = [], 0
    for block in func.body.blocks:
        bindings = []
        for binding in block.bindings:
            value = binding.value
            if position in replace:
                value = replace[position]
            elif position in variants:
                value = relax.Call(new_kernels[variants[position].name_hint], value.args,
                                   value.attrs, value.ty_args)
            bindings.append(relax.VarBinding(binding.var, value))
            position += 1
        blocks.append(block.__class__(bindings))
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="UpdateInPlace")
class UpdateInPlace:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        builder = relax.BlockBuilder(mod.clone())  # the caller's module stays as it was
        for gvar, func in mod.functions_items():
            if (isinstance(func, relax.Function) and func.attrs is not None
                    and UPDATED_ARGUMENTS in func.attrs):
                builder.update_func(gvar, _rewrite(builder, mod, func, gvar.name_hint))
        return builder.get()
