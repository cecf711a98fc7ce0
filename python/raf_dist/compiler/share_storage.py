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
it) and assigns them again with an offline rule, in one pool for every dtype: greedy by size
for offset calculation (``assign_offsets``) and greedy by size for shared objects
(``assign_shared_objects``), whichever is smaller; TVM's plan is kept where it is as small.

**Offsets in one arena.** Shared objects (a tensor always at the start of its block) waste
what a block's largest tensor leaves free while a smaller one lives in it: GPT-2 124M's bf16
step has logits-sized tensors (the loss's 154 MB float32 copy, 51 MB bf16 logits) beside
9 MB activations, and its shared-object plan was 1050 MB against 710 MB of tensors ever live
at once (float32: 1158 against 866). Offsets pack the small tensors side by side where a large
one lives at another time: one ``alloc_storage`` of the arena's bytes, one uint8 tensor on it,
and each planned tensor a ``raf_dist.arena.view(arena, byte_offset, shape, dtype)`` (64-byte
aligned offsets: TVM's kernels assume aligned data). Not ``R.memory.alloc_tensor(storage,
offset > 0, ...)``: TVM sets the DLTensor's byte_offset then, and every kernel it generates
asserts byte_offset == 0 (the view's data pointer points into the arena). A view is one call,
as the ``alloc_tensor`` it replaces, and the ~300 ``alloc_storage`` calls of a step become one.

Lifetimes are conservative: a binding's variable is taken to alias every planned tensor its
value mentions (views, tuples, a collective's handle, a packed call's result), so a tensor
lives until the last use of anything that could hold it; a value the function returns lives
to the end. A function whose planned storage is not a top-level binding with a static size
(dynamic shapes, a storage used inside a nested scope) is left as TVM planned it.
"""
import bisect

import tvm
from tvm import relax

from ..ir.ops import ARENA_VIEW
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


def assign_shared_objects(tokens, sizes):
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


#: bytes an arena offset is a multiple of (TVM's kAllocAlignment; its kernels assume it)
ALIGNMENT = 64


def _aligned(size):
    return -(-size // ALIGNMENT) * ALIGNMENT


def assign_offsets(tokens, sizes):
    """({tensor var: byte offset}, arena bytes): greedy by size for offset calculation
    (Pisarchyk and Lee 2020, section 5; TensorFlow Lite's arena planner) — tensors in order,
    each into the smallest gap (between tensors placed already that live at the same time, by
    offset) that holds it, else above the highest of them — run in two orders, by decreasing
    size and by decreasing size x lifetime, the smaller arena kept. On GPT-2 124M's bf16
    step the second is 774 MB against 813 (lower bound, the bytes live at once: 710); on
    its float32 step 880 against 897 (866)."""
    by_size = sorted(tokens, key=lambda v: (-sizes[v], tokens[v][0]))
    by_area = sorted(tokens, key=lambda v: (-sizes[v] * (tokens[v][1] - tokens[v][0] + 1),
                                            tokens[v][0]))
    return min((_place(order, tokens, sizes) for order in (by_size, by_area)),
               key=lambda plan: plan[1])


def _place(order, tokens, sizes):
    """``assign_offsets``'s placement of the tensors in ``order``."""
    placed = []  # (offset, end, first, last), ordered by offset
    offset_of, total = {}, 0
    for var in order:
        first, last = tokens[var]
        size = _aligned(sizes[var])
        below, best, best_gap = 0, None, None
        for offset, end, start, stop in placed:
            if stop < first or start > last:  # not alive together: may overlap
                continue
            gap = offset - below
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = below, gap
            below = max(below, end)
        if best is None:
            best = below
        bisect.insort(placed, (best, best + size, first, last), key=lambda p: p[0])
        offset_of[var] = best
        total = max(total, best + size)
    return offset_of, total


def _replan(func):
    if not isinstance(func.body, relax.SeqExpr):
        return None
    bindings = [b for block in func.body.blocks for b in block.bindings]
    tokens = _lifetimes(bindings, func.body.body)
    if not tokens:
        return None
    sizes = {b.var: _tensor_bytes(b.value) for b in bindings if b.var in tokens}
    block_of, block_sizes = assign_shared_objects(tokens, sizes)
    offset_of, arena_bytes = assign_offsets(tokens, sizes)
    planned_before = sum(_static_bytes(b.value) for b in bindings if _is(b, _ALLOC_STORAGE))
    if min(sum(block_sizes), arena_bytes) >= planned_before:  # TVM's plan is as small: keep it
        return None
    # the device index, scope and dtype hint of each tensor's old storage, for its new one
    storage_args = {b.var: list(b.value.args[1:]) for b in bindings if _is(b, _ALLOC_STORAGE)}
    if arena_bytes < sum(block_sizes):
        return _in_arena(func, storage_args, offset_of, arena_bytes)
    first_user = {}
    for binding in bindings:
        if binding.var in block_of:
            first_user.setdefault(block_of[binding.var], binding)
    storage_vars = {block: relax.Var(f"shared_storage{block}", relax.ObjectType())
                    for block in first_user}

    def in_block(binding, normalize):
        b, call = block_of[binding.var], binding.value
        out = []
        if first_user[b].same_as(binding):
            out.append(relax.VarBinding(storage_vars[b], normalize(relax.Call(
                _ALLOC_STORAGE, [relax.ShapeExpr([block_sizes[b]]),
                                 *storage_args[call.args[0]]]))))
        return out + [relax.VarBinding(binding.var, normalize(relax.Call(
            _ALLOC_TENSOR, [storage_vars[b], *call.args[1:]], call.attrs, call.ty_args)))]

    return _with_allocations(func, block_of, in_block)


def _in_arena(func, storage_args, offset_of, arena_bytes):
    """``func`` with its planned tensors views at ``offset_of`` into one arena of
    ``arena_bytes``, allocated where the first of them was, on the device and scope of its
    old storage (``storage_args``: each storage's arguments after its size)."""
    storage = relax.Var("arena_storage", relax.ObjectType())
    arena = relax.Var("arena", relax.TensorType([arena_bytes], "uint8"))
    placed = []

    def view(binding, normalize):
        call, out = binding.value, []
        if not placed:
            device, scope = storage_args[call.args[0]][:2]
            out.append(relax.VarBinding(storage, normalize(relax.op.memory.alloc_storage(
                relax.ShapeExpr([arena_bytes]), device, scope, "uint8"))))
            out.append(relax.VarBinding(arena, normalize(relax.op.memory.alloc_tensor(
                storage, relax.prim_value(0), relax.ShapeExpr([arena_bytes]), "uint8"))))
            placed.append(arena)
        return out + [relax.VarBinding(binding.var, normalize(relax.Call(
            relax.ExternFunc(ARENA_VIEW),
            [arena, relax.prim_value(offset_of[binding.var]), call.args[2],
             tvm.ir.StringImm(str(call.args[3].value))], ty_args=[binding.var.ty])))]

    return _with_allocations(func, offset_of, view)


def _with_allocations(func, planned, replace):
    """``func`` without its ``alloc_storage`` bindings, each binding of a tensor in
    ``planned`` replaced by the bindings ``replace(binding, normalize)`` returns."""
    normalize = relax.BlockBuilder().normalize
    new_blocks = []
    for block in func.body.blocks:
        out = []
        for binding in block.bindings:
            if _is(binding, _ALLOC_STORAGE):
                continue
            out.extend(replace(binding, normalize) if binding.var in planned else [binding])
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
