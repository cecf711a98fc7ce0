"""AddLookupGradient: a table's gradient that is a dense gradient plus its lookups' scatter-add
becomes one kernel that writes the dense gradient into the result and adds the looked-up
rows' gradients there.

Input: a module before LegalizeOps (the training step after TVM's Gradient pass, the
distribution passes and AutoCast). Output: every

    t = R.grad.take_backward(dy, W, ids, axis=0)      # dy (n, D), W (V, D), ids (n,)
    g = R.add(a, t)                                   # (or add(t, a)); a of W's type

where ``t`` has no other use, W, ``a`` and ``dy`` are float32 and every variable the kernel
reads is visible in the add's dataflow block, becomes ``g = take_backward_add(b, dy, ids)``: ``g[v] = b[v] +
sum of dy[k] over k with ids[k] = v``, with ``b = a``, or ``b = u`` when ``a = astype(u, W's
dtype)`` is a widened 16-bit value used nowhere else (the cast is done in the kernel's first
loop).

Why: this is a tied embedding's gradient (GPT-2's, T5's, any ``lm_head.weight is
wte.weight``): the LM head's dense weight gradient plus the input lookup's. TVM's
take_backward materialises a zero-filled (V, D) tensor for the lookup's few rows and the add
a third one, so three vocabulary-sized float32 tensors are alive at the end of the backward
(GPT-2 124M: 154 MB each, the peak of its step). Here only the result is written; under
mixed precision the LM head's 16-bit gradient is kept until the end of the backward in place
of its float32 widening (half the bytes). The arithmetic reassociates: the rows are added
onto ``b[v]`` one by one, ``(b + r1) + r2``, where the two ops computed ``b + (r1 + r2)``
(float32 rounding apart, the same sum; PyTorch adds the two gradients as the two ops did). A
test bounds its distance from the float64 sum by twice the two ops' own.

The kernel is take_backward's own (TVM's legalization: a first loop over the table, then the
accumulation loop over columns and, inside, the ids in order) with the first loop copying
``b`` instead of writing zeros; it keeps the block name ``take_backward`` so that the CPU
and GPU schedules of the scatter-add (compiler/scatter_add.py, schedule_gpu.py) apply as
they are.
"""
from typing import Dict

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T
from tvm.tirx.script.builder.utils import buffer_proxy

from ..ir.utils import op_name
from .auto_cast import LOW_DTYPES
from .tp_layout import static_shape

_TAKE_BACKWARD = "relax.grad.take_backward"


def _take_backward_add_te(base, output_grad, indices, dtype):
    """(V, D) ``dtype``: ``base`` (any float dtype, widened) plus ``output_grad``'s rows
    (n, D) scatter-added at ``indices`` (n,), in order."""
    rows, cols = (int(d) for d in base.shape)
    count = int(indices.shape[0])

    def gen_ir(base_ptr, grad_ptr, idx_ptr, out_ptr):
        out, src, grad, idx = (buffer_proxy(p) for p in (out_ptr, base_ptr, grad_ptr, idx_ptr))
        with IRBuilder() as ib:
            with T.seq_scope():
                with T.serial(rows * cols) as i:  # take_backward's zero fill, a copy here
                    out[i] = src[i].astype(dtype)
                with T.serial(cols) as j:  # take_backward's accumulation, unchanged
                    with T.serial(count) as k:
                        at = idx[k] * cols + j
                        out[at] = out[at] + grad[k * cols + j]
            return ib.get()

    out_buf = tirx.decl_buffer(base.shape, dtype, "out_buf")
    return te.extern([base.shape], [base, output_grad, indices],
                     lambda ins, outs: gen_ir(ins[0], ins[1], ins[2], outs[0]),
                     dtype=dtype, out_buffers=[out_buf], name="take_backward",
                     tag="take_backward")


@visitor
class _Uses(PyExprVisitor):
    """How often each variable is read, the value bound to each, and the dataflow block each
    block-local variable is defined in."""

    def __init__(self):
        super().__init__()
        self.uses: Dict[relax.Var, int] = {}
        self.value: Dict[relax.Var, relax.Expr] = {}
        self.block: Dict[relax.Var, int] = {}
        self._blocks = 0

    def visit_dataflow_block_(self, block):
        self._blocks += 1
        for binding in block.bindings:
            self.visit_binding(binding)

    def visit_var_binding_(self, binding):
        self.value[binding.var] = binding.value
        if isinstance(binding.var, relax.DataflowVar):
            self.block[binding.var] = self._blocks
        self.visit_expr(binding.value)

    def visit_var_(self, var):
        self.uses[var] = self.uses.get(var, 0) + 1

    def visit_dataflow_var_(self, var):
        self.uses[var] = self.uses.get(var, 0) + 1


@mutator
class _Rewrite(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.uses = _Uses()
        self.changed = False

    def _visible(self, var, block):
        """Whether ``var`` may be read in dataflow block ``block``: a variable outside any
        dataflow block (a parameter, a block's output) or one defined in that block."""
        return isinstance(var, relax.Var) and (not isinstance(var, relax.DataflowVar)
                                               or self.uses.block.get(var) == block)

    def _lookup(self, var):
        """(dy, ids, block) when ``var`` is a float32 table's take_backward along axis 0 of
        static 1-D ids, read once, bound in a dataflow block whose variables dy and ids are."""
        call = self.uses.value.get(var) if isinstance(var, relax.DataflowVar) else None
        if op_name(call) != _TAKE_BACKWARD or self.uses.uses.get(var, 0) != 1:
            return None
        if call.attrs.axis is None or int(call.attrs.axis) != 0:
            return None
        dy, table, ids = call.args
        table_shape, dy_shape, ids_shape = static_shape(table), static_shape(dy), static_shape(ids)
        # float32 tables only: with a 16-bit table the rows would be added in 16 bits one by
        # one, a rounding the two ops do not make
        if table_shape is None or len(table_shape) != 2 or dy_shape is None \
                or len(dy_shape) != 2 or ids_shape != dy_shape[:1] \
                or str(table.ty.dtype) != "float32" or str(dy.ty.dtype) != "float32":
            return None
        block = self.uses.block[var]
        if not (self._visible(dy, block) and self._visible(ids, block)):
            return None
        return dy, ids, block

    def _base(self, var, block):
        """What the kernel copies for the dense float32 summand ``var``: its 16-bit source
        when it is a widening in the same block read nowhere else, else itself (None: not
        readable in ``block``)."""
        if not self._visible(var, block):
            return None
        value = self.uses.value.get(var)
        if op_name(value) == "relax.astype" and self.uses.uses.get(var, 0) == 1 \
                and isinstance(var, relax.DataflowVar):
            source = value.args[0]
            if self._visible(source, block) and str(source.ty.dtype) in LOW_DTYPES:
                return source
        return var

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) != "relax.add":
            return call
        for dense, lookup in ((call.args[0], call.args[1]), (call.args[1], call.args[0])):
            found = self._lookup(lookup)
            if found is None:
                continue
            dy, ids, block = found
            if not isinstance(dense, relax.Var) or dense.same_as(lookup) \
                    or static_shape(dense) != static_shape(lookup) \
                    or str(dense.ty.dtype) != "float32":
                continue
            base = self._base(dense, block)
            if base is None:
                continue
            self.changed = True
            return self.builder_.call_te(_take_backward_add_te, base, dy, ids, "float32",
                                         primfunc_name_hint="take_backward_add")
        return call


@tvm.transform.module_pass(opt_level=0, name="AddLookupGradient")
class AddLookupGradient:
    """See the module docstring."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        rewrite = _Rewrite(mod)
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            rewrite.uses, rewrite.changed = _Uses(), False
            rewrite.uses.visit_expr(func)
            out = rewrite.visit_expr(func)
            if rewrite.changed:  # the scatter-add and the widening it replaced
                out = relax.analysis.remove_all_unused(out)
            rewrite.builder_.update_func(gvar, out)
        return rewrite.builder_.get()
