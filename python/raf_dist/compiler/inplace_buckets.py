"""WriteGradientsIntoBuckets: gradients are computed directly in their bucket — no copy
between the kernel that produces a gradient and the collective that reduces it.

Runs after CallTIRRewrite and before StaticPlanBlockMemory, on functions containing
``raf_dist.bucket.pack(g_1, ..., g_k, offsets, total)`` (AllReduceGradients emits it; the
reduced gradients are read back through zero-copy ``raf_dist.bucket.view`` calls).
For every pack:
  - ``bucket = raf_dist.bucket.empty(like, total, dtype)`` is placed before the first of the
    bucket's gradients is computed (``like`` is the function's first tensor parameter: the
    bucket lives on its device). It is a runtime allocation the planner does not see, so
    nothing else is ever placed on it;
  - each gradient traced through aliases and reshapes to the ``R.builtin.alloc_tensor`` its
    kernel writes into (CallTIRRewrite's output allocation) gets
    ``raf_dist.bucket.view(bucket, offset, shape, pad)`` instead: the kernel (generated TIR or
    BLAS) writes the gradient into the bucket at its 64-byte aligned offset, and the memory
    planner no longer allocates it at all;
  - a gradient that cannot be traced (a function parameter, a tuple element, a tensor used
    again after the pack) is copied in with ``raf_dist.bucket.copy_into`` where the pack was;
  - the pack binding becomes ``bucket_var = bucket``.
Views own a reference to the bucket, so the bucket lives until its last view is dead (the
optimizer's reads of the reduced gradients), whatever KillAfterLastUse does with the bucket
variable itself.

Why views and not ``R.memory.alloc_tensor(storage, offset > 0, ...)``: such a tensor has a
non-zero DLTensor byte_offset and every kernel TVM 0.27 generates asserts byte_offset == 0; a
view's data pointer points into the bucket and its byte_offset is 0.
"""
import tvm
from tvm import relax

from ..ir.utils import tensor_numel

BUCKET_PACK = "raf_dist.bucket.pack"
BUCKET_VIEW = "raf_dist.bucket.view"
BUCKET_COPY_INTO = "raf_dist.bucket.copy_into"
BUCKET_EMPTY = "raf_dist.bucket.empty"
_CALL_PURE_PACKED = tvm.ir.Op.get("relax.call_pure_packed")
_ALLOC_TENSOR = tvm.ir.Op.get("relax.builtin.alloc_tensor")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_VOID = relax.TupleType([])


def packed_call(expr):
    """(symbol, args) of ``R.call_packed``/``R.call_pure_packed`` to an extern function."""
    if not isinstance(expr, relax.Call):
        return None, None
    if isinstance(expr.op, relax.ExternFunc):
        return expr.op.global_symbol, list(expr.args)
    if expr.op == _CALL_PURE_PACKED and isinstance(expr.args[0], relax.ExternFunc):
        return expr.args[0].global_symbol, list(expr.args[1:])
    return None, None


def is_static_tensor(ty):
    """Whether ``ty`` is a tensor type of known, constant shape."""
    return (isinstance(ty, relax.TensorType) and ty.shape is not None
            and all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape))


class LoweredFunction:
    """The bindings of one lowered function, with where each variable is defined and used."""

    def __init__(self, func):
        self.bindings = [b for block in func.body.blocks for b in block.bindings]
        self.position = {b.var: i for i, b in enumerate(self.bindings)}
        self.value = {b.var: b.value for b in self.bindings}
        self.uses = {}
        for i, b in enumerate(self.bindings):
            for var in relax.analysis.free_vars(b.value):
                self.uses.setdefault(var, []).append(i)
        for var in relax.analysis.free_vars(func.body.body):
            self.uses.setdefault(var, []).append(len(self.bindings))

    def allocation(self, grad, before):
        """The alloc_tensor binding ``grad`` is computed into, through aliases and
        reshapes, if the gradient may live in the bucket: same element count, and neither it
        nor any alias of it used at or after position ``before`` (except by the pack)."""
        chain, var = [grad], grad
        while True:
            value = self.value.get(var)
            if isinstance(value, relax.Var):
                var = value
            elif isinstance(value, relax.Call) and value.op == _RESHAPE:
                var = value.args[0]
            else:
                break
            if not isinstance(var, relax.Var):
                return None
            chain.append(var)
        value = self.value.get(var)
        if not (isinstance(value, relax.Call) and value.op == _ALLOC_TENSOR
                and is_static_tensor(var.ty) and tensor_numel(var.ty) == tensor_numel(grad.ty)
                and str(var.ty.dtype) == str(grad.ty.dtype)):
            return None
        if any(u > before for v in chain for u in self.uses.get(v, [])):
            return None  # read again after the pack: it must keep its unreduced value
        return var


def _rewrite(func):
    like = next((v for v in func.params if isinstance(v.ty, relax.TensorType)), None)
    if like is None:
        return func
    info = LoweredFunction(func)
    normalize = relax.BlockBuilder().normalize
    replace, insert_before, claimed = {}, {}, set()
    for i, binding in enumerate(info.bindings):
        symbol, args = packed_call(binding.value)
        if symbol != BUCKET_PACK:
            continue
        # relax.prim_value(...) is a tirx IntImm in TVM 0.27
        grads, offsets, total = args[:-2], [int(v) for v in args[-2].values], int(args[-1].value)
        ty = binding.var.ty
        bucket = relax.Var(f"{binding.var.name}_memory", ty)
        copies, mine = [], []
        for k, (grad, offset) in enumerate(zip(grads, offsets)):
            end = offsets[k + 1] if k + 1 < len(offsets) else total
            pad = relax.prim_value(end - offset - tensor_numel(grad.ty))
            at = relax.prim_value(offset)
            root = info.allocation(grad, i) if isinstance(grad, relax.Var) else None
            if root is None or root in claimed:
                copies.append(normalize(relax.Call(relax.ExternFunc(BUCKET_COPY_INTO),
                                                   [grad, bucket, at, pad], ty_args=[_VOID])))
                continue
            claimed.add(root)
            mine.append(info.position[root])
            replace[info.position[root]] = normalize(relax.Call(
                relax.ExternFunc(BUCKET_VIEW),
                [bucket, at, relax.ShapeExpr([int(d) for d in root.ty.shape]), pad],
                ty_args=[root.ty]))
        first = min(mine, default=i)
        alloc = normalize(relax.Call(relax.ExternFunc(BUCKET_EMPTY), [
            like, relax.prim_value(total), tvm.ir.StringImm(str(ty.dtype))],
            ty_args=[ty]))
        insert_before.setdefault(first, []).append(relax.VarBinding(bucket, alloc))
        replace[i] = [relax.VarBinding(relax.Var(f"_copy{j}", _VOID), c)
                      for j, c in enumerate(copies)] + [relax.VarBinding(binding.var, bucket)]
    if not insert_before:
        return func

    blocks, p = [], 0
    for block in func.body.blocks:
        new = []
        for b in block.bindings:
            new.extend(insert_before.get(p, []))
            r = replace.get(p, b.value)
            new.extend(r if isinstance(r, list) else [relax.VarBinding(b.var, r)])
            p += 1
        blocks.append(relax.BindingBlock(new))
    return relax.Function(func.params, normalize(relax.SeqExpr(blocks, func.body.body)),
                          func.ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="WriteGradientsIntoBuckets")
class WriteGradientsIntoBuckets:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        updates = {gvar: _rewrite(func) for gvar, func in mod.functions_items()
                   if isinstance(func, relax.Function)}
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod
