"""ShareStorageAcrossDtypes: the step's temporaries re-planned onto storage blocks that any
dtype may reuse. Runs right after TVM's StaticPlanBlockMemory.

TVM 0.27's planner (``StaticPlanBlockMemory``'s ``TokenAllocator1D``) keeps one pool of free
storage per dtype: a float32 block freed in the forward is never reused by a bfloat16 tensor
of the backward, nor the other way round. A mixed-precision step has both kinds everywhere
(bf16 activations, float32 norms, softmax, loss and gradients), so its plan grew to the sum of
two plans: the bf16 step of bench/mixed_precision.py's 23M GPT planned 308 MiB, as much as the
float32 step, against a peak of 235 MiB of tensors live at once. A storage block is bytes (the
VM checks only that a tensor fits it; the dtype of ``alloc_storage`` is an alignment hint), so
this pass takes every tensor TVM placed (``memory.alloc_tensor`` on a planned storage), its
lifetime (its binding to the last binding that reads it or anything derived from it), and
assigns the tensors again with TVM's own best-fit rule but one pool for every dtype.

Lifetimes are conservative: a binding's variable is taken to alias every planned tensor its
value mentions (views, tuples, a collective's handle, a packed call's result), so a tensor
lives until the last use of anything that could hold it; a value the function returns lives
to the end. A function whose planned storage is not a top-level binding with a static size
(dynamic shapes, a storage used inside a nested scope) is left as TVM planned it.
"""
import tvm
from tvm import relax

_ALLOC_STORAGE = tvm.ir.Op.get("relax.memory.alloc_storage")
_ALLOC_TENSOR = tvm.ir.Op.get("relax.memory.alloc_tensor")
#: TVM's TokenAllocator1D reuses a free block between size / 16 and size * 16 (growing a
#: smaller one); the same rule here, so only the pooling across dtypes differs
_MATCH_RANGE = 16


def _static_bytes(call):
    shape = call.args[0]
    if not (isinstance(shape, relax.ShapeExpr) and len(shape.values) == 1
            and isinstance(shape.values[0], tvm.tirx.IntImm)):
        return None
    return int(shape.values[0].value)


def _tensor_bytes(call):
    shape, dtype = call.args[2], tvm.DataType(str(call.args[3].value))
    if not (isinstance(shape, relax.ShapeExpr)
            and all(isinstance(d, tvm.tirx.IntImm) for d in shape.values)):
        return None
    numel = 1
    for d in shape.values:
        numel *= int(d.value)
    return numel * ((dtype.bits + 7) // 8) * dtype.lanes


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


class _Pool:
    """Storage blocks of any dtype, reused by TVM's best-fit rule."""

    def __init__(self):
        self.sizes = []  # block -> bytes (grown as larger tensors take it)
        self.free = set()

    def take(self, nbytes):
        free = sorted(self.free, key=lambda b: self.sizes[b])
        larger = [b for b in free if nbytes <= self.sizes[b] <= nbytes * _MATCH_RANGE]
        smaller = [b for b in free if nbytes / _MATCH_RANGE <= self.sizes[b] < nbytes]
        if larger:
            block = larger[0]
        elif smaller:
            block = smaller[-1]
            self.sizes[block] = nbytes
        else:
            self.sizes.append(nbytes)
            return len(self.sizes) - 1
        self.free.discard(block)
        return block


def _replan(func):
    if not isinstance(func.body, relax.SeqExpr):
        return None
    bindings = [b for block in func.body.blocks for b in block.bindings]
    tokens = _lifetimes(bindings, func.body.body)
    if not tokens:
        return None
    pool = _Pool()
    block_of = {}
    ends = sorted(((last, var) for var, (_, last) in tokens.items()), key=lambda e: e[0])
    released = 0
    for i, binding in enumerate(bindings):
        if binding.var not in tokens:
            continue
        while released < len(ends) and ends[released][0] < i:
            pool.free.add(block_of[ends[released][1]])
            released += 1
        block_of[binding.var] = pool.take(_tensor_bytes(binding.value))
    planned_before = sum(_static_bytes(b.value) for b in bindings if _is(b, _ALLOC_STORAGE))
    if sum(pool.sizes) >= planned_before:  # TVM's plan is as small: keep it
        return None
    first_user = {}
    for binding in bindings:
        if binding.var in block_of:
            first_user.setdefault(block_of[binding.var], binding)
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
                        _ALLOC_STORAGE, [relax.ShapeExpr([pool.sizes[b]]),
                                         *_storage_tail(bindings, call.args[0])]))))
                binding = relax.VarBinding(binding.var, normalize(relax.Call(
                    _ALLOC_TENSOR, [storage_vars[b], *call.args[1:]], call.attrs,
                    call.ty_args)))
            out.append(binding)
        new_blocks.append(relax.BindingBlock(out))
    return relax.Function(func.params, normalize(relax.SeqExpr(new_blocks, func.body.body)),
                          func.ret_ty, func.is_pure, func.attrs)


def _storage_tail(bindings, storage_var):
    """The device index, scope and dtype arguments of the alloc_storage bound to ``storage_var``."""
    for binding in bindings:
        if binding.var.same_as(storage_var):
            return list(binding.value.args[1:])
    raise AssertionError(f"no alloc_storage for {storage_var.name}")


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
