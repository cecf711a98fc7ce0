"""ShareStorageAcrossDtypes: the step's temporaries planned again, after TVM's
StaticPlanBlockMemory, onto storage blocks that tensors of any dtype share, placed by
decreasing size.

TVM 0.27's planner (``StaticPlanBlockMemory``'s ``TokenAllocator1D``) has two habits that cost
memory on a training step. It keeps one pool of free storage per dtype: a float32 block freed
in the forward is never reused by a bfloat16 tensor of the backward, nor the other way round,
and a mixed-precision step has both everywhere (bf16 activations; float32 norms, softmax,
loss, gradients), so its plan grew to nearly the sum of two plans. And it assigns online, in
execution order (a free block from size / 16 to size x 16, a smaller one grown): a small
early tensor takes a large block that a large later tensor then cannot have. The bf16 step of
bench/mixed_precision.py's 23M GPT planned 308 MiB, as much as its float32 step, against a
peak of 235 MiB of tensors live at once.

A storage block is bytes (the VM checks only that a tensor fits it; the dtype of
``alloc_storage`` is an alignment hint), and every lifetime is known for the whole step. So
this pass takes every tensor TVM placed (``memory.alloc_tensor`` on a planned storage) with
its lifetime (from its binding to the last binding that reads it or anything derived from
it) and assigns them again with an offline rule, greedy by size for shared objects
(``_assign``), in one pool for every dtype; TVM's plan is kept where it is as small.

Lifetimes are conservative: a binding's variable is taken to alias every planned tensor its
value mentions (views, tuples, a collective's handle, a packed call's result), so a tensor
lives until the last use of anything that could hold it; a value the function returns lives
to the end. A function whose planned storage is not a top-level binding with a static size
(dynamic shapes, a storage used inside a nested scope) is left as TVM planned it.
"""
import tvm
from tvm import relax

from .memory import nbytes, static_size

_ALLOC_STORAGE = tvm.ir.Op.get("relax.memory.alloc_storage")
_ALLOC_TENSOR = tvm.ir.Op.get("relax.memory.alloc_tensor")


def _static_bytes(call):
    """Bytes of an ``alloc_storage`` (its shape is [bytes]), None when not static."""
    return static_size(call.args[0])


def _tensor_bytes(call):
    """Bytes of an ``alloc_tensor`` (storage, offset, shape, dtype), None when not static."""
    numel = static_size(call.args[2])
    return None if numel is None else nbytes(numel, call.args[3].value)


def _is(binding, op):
    value = binding.value
    return isinstance(value, relax.Call) and value.op == op


def _nested_allocations(expr):
    """Whether ``expr`` (a binding's value) holds a planned allocation inside a nested scope."""
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and e.op in (_ALLOC_STORAGE, _ALLOC_TENSOR):
            found.append(e)

    if isinstance(expr, (relax.If, relax.SeqExpr, relax.Function)):
        relax.analysis.post_order_visit(expr, visit)
    return bool(found)


def _lifetimes(bindings, body_result):
    """{planned tensor var: (first binding, last binding that may read it)} over the flat
    top-level ``bindings``; None when the function is not one this pass handles."""
    tokens = {}  # alloc_tensor var -> [def index, last use index]
    roots = {}  # var -> set of alloc_tensor vars it may alias
    storages = set()
    for i, binding in enumerate(bindings):
        if _is(binding, _ALLOC_STORAGE):
            if _static_bytes(binding.value) is None:
                return None
            storages.add(binding.var)
            continue
        if _is(binding, _ALLOC_TENSOR):
            if binding.value.args[0] not in storages or _tensor_bytes(binding.value) is None:
                return None
            tokens[binding.var] = [i, i]
            roots[binding.var] = {binding.var}
            continue
        if _nested_allocations(binding.value):
            return None
        mentioned = set()
        for var in relax.analysis.free_vars(binding.value):
            if var in storages:  # a storage used other than by alloc_tensor
                return None
            mentioned |= roots.get(var, set())
        for token in mentioned:
            tokens[token][1] = i
        if mentioned:
            roots[binding.var] = mentioned
    end = len(bindings)
    for var in relax.analysis.free_vars(body_result):
        for token in roots.get(var, ()):
            tokens[token][1] = end
    return tokens


def _assign(tokens, sizes):
    """({tensor var: block}, [block bytes]): greedy by size for shared objects (Pisarchyk
    and Lee 2020, TensorFlow Lite's planner): the tensors by decreasing size, each into the
    smallest block none of whose tensors is alive at the same time, else a new block. The
    lifetimes are known for the whole step, so the large tensors are placed first instead of
    in execution order (TVM's online rule lets a small early tensor take a large block)."""
    block_sizes, block_lives, block_of = [], [], {}
    for var in sorted(tokens, key=lambda v: (-sizes[v], tokens[v][0])):
        first, last = tokens[var]
        free = [b for b, lives in enumerate(block_lives)
                if all(end < first or start > last for start, end in lives)]
        if free:  # every block is at least as large: its first tensor was
            block = min(free, key=lambda b: block_sizes[b])
        else:
            block = len(block_sizes)
            block_sizes.append(sizes[var])
            block_lives.append([])
        block_lives[block].append((first, last))
        block_of[var] = block
    return block_of, block_sizes


def _replan(func):
    if not isinstance(func.body, relax.SeqExpr):
        return None
    bindings = [b for block in func.body.blocks for b in block.bindings]
    tokens = _lifetimes(bindings, func.body.body)
    if not tokens:
        return None
    sizes = {b.var: _tensor_bytes(b.value) for b in bindings if b.var in tokens}
    block_of, block_sizes = _assign(tokens, sizes)
    planned_before = sum(_static_bytes(b.value) for b in bindings if _is(b, _ALLOC_STORAGE))
    if sum(block_sizes) >= planned_before:  # TVM's plan is as small: keep it
        return None
    first_user = {}
    for binding in bindings:
        if binding.var in block_of:
            first_user.setdefault(block_of[binding.var], binding)
    # the device index, scope and dtype hint of each tensor's old storage, for its new one
    storage_args = {b.var: list(b.value.args[1:]) for b in bindings if _is(b, _ALLOC_STORAGE)}
    normalize = relax.BlockBuilder().normalize
    storage_vars = {block: relax.Var(f"shared_storage{block}", relax.ObjectType())
                    for block in first_user}
    new_blocks = []
    for block in func.body.blocks:
        out = []
        for binding in block.bindings:
            if _is(binding, _ALLOC_STORAGE):
                continue
            if binding.var in block_of:
                b = block_of[binding.var]
                call = binding.value
                if first_user[b].same_as(binding):
                    out.append(relax.VarBinding(storage_vars[b], normalize(relax.Call(
                        _ALLOC_STORAGE, [relax.ShapeExpr([block_sizes[b]]),
                                         *storage_args[call.args[0]]]))))
                binding = relax.VarBinding(binding.var, normalize(relax.Call(
                    _ALLOC_TENSOR, [storage_vars[b], *call.args[1:]], call.attrs,
                    call.ty_args)))
            out.append(binding)
        new_blocks.append(relax.BindingBlock(out))
    return relax.Function(func.params, normalize(relax.SeqExpr(new_blocks, func.body.body)),
                          func.ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="ShareStorageAcrossDtypes")
class ShareStorageAcrossDtypes:
    """The module docstring's pass over every Relax function of the module."""

    def transform_module(self, mod, ctx):
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                replanned = _replan(func)
                if replanned is not None:
                    updates[gvar] = replanned
        if not updates:
            return mod
        mod = mod.clone()
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod
