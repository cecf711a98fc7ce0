"""Eager attention written out (``softmax(q @ k.transpose(-1, -2) * scale + mask) @ v``, what
transformers' "eager" attention of GPT-2, Llama, Qwen and Mistral computes) found in an
imported forward and replaced by raf_dist's attention op (ir/attention.py), so the step never
holds the T x T scores, their softmax or their gradients.

The importer writes each 4-d batched matmul as 3-d: ``reshape(broadcast_to(x, same shape),
(B*H, T, D))``, the product, and a reshape back. ``fuse_eager_attention`` reads through those
views (``_source``) to the 4-d q, k^T and v, and matches

    S = reshape(matmul(view(q), view(permute_dims(k, [0, 1, 3, 2]))), (B, H, Tq, Tk))
    S' = S * c | S / c | S                  (c a scalar constant: the scale)
    S'' = S' + mask | S'                    (mask: an additive float mask, kept as it is)
    O = matmul(view(softmax(S'', axis=-1)), view(v))

when S, S', S'' and the softmax are read by nothing else (a model that also returns its
attention weights keeps them). O's binding becomes the op's output viewed as the matmul
was; the rest is left for dead-code elimination.

transformers builds eager attention's causal mask as a (B, 1, T, T) tensor from aranges
(``where(j <= i, 0, finfo.min)``). A mask computed from constants alone is evaluated once at
capture (``_static_value``: its bindings compiled and run); one that is 0 on and below the
diagonal and far below any score above it (<= -1e4: exp underflows to exactly 0 in float32,
bf16 and fp16) is the causal flag, and the op takes ``causal=True`` with no mask: nothing
T x T is left, and the kernel skips the masked blocks. Any other mask (padding, an input)
stays as it is, one tensor shared by the layers.
Dropout on the probabilities (attn_pdrop > 0 in training) breaks the pattern: that
attention keeps today's path (one log line names it).
"""
import logging
from typing import Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, PyExprVisitor, mutator, visitor

from ..ir.attention import attention, has_mask, is_attention

_LOG = logging.getLogger("raf_dist")
_VIEWS = ("relax.reshape", "relax.broadcast_to")


def _name(expr: relax.Expr) -> str:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return str(expr.op.name)
    return ""


def _shape(expr: relax.Expr) -> Tuple[int, ...]:
    return tuple(int(d) for d in expr.ty.shape)


@visitor
class _Uses(PyExprVisitor):
    """How many times each variable is read, and what each is bound to."""

    def __init__(self) -> None:
        self.count: Dict[relax.Var, int] = {}
        self.value: Dict[relax.Var, relax.Expr] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.value[binding.var] = binding.value
        self.visit_expr(binding.value)

    def visit_var_(self, var: relax.Var) -> None:
        self.count[var] = self.count.get(var, 0) + 1

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> None:
        self.visit_var_(var)


class _Matcher:
    def __init__(self, uses: _Uses, weights: FrozenSet[relax.Var]) -> None:
        self.uses, self.weights = uses, weights  # weights: the forward's parameter vars
        self.depends: Dict[relax.Expr, bool] = {}

    def bound(self, expr: relax.Expr, op: str, once: bool = True) -> Optional[relax.Call]:
        """The call of ``op`` ``expr`` is bound to (read only here when ``once``), else None."""
        if not isinstance(expr, relax.Var):
            return None
        value = self.uses.value.get(expr)
        if _name(value) != op or (once and self.uses.count.get(expr, 0) != 1):
            return None
        return value

    def source(self, expr: relax.Expr) -> relax.Expr:
        """The 4-d tensor a 3-d matmul operand views, or ``expr``: through reshapes to the
        first 4-d value whose (B * H, T, D) is the operand's shape, then through same-shape
        broadcast_to only (a reshape regrouping the 4-d axes is no view of it)."""
        target, found = _shape(expr), None
        while isinstance(expr, relax.Var):
            value = self.uses.value.get(expr)
            if value is None:
                break
            name = _name(value)
            identity = name == "relax.broadcast_to" and _shape(value.args[0]) == _shape(value)
            if not identity and (name != "relax.reshape" or found is not None):
                break
            expr = value.args[0]
            shape = _shape(expr)
            if found is not None or (len(shape) == 4
                                     and (shape[0] * shape[1],) + shape[2:] == target):
                found = expr
        return found if found is not None else expr

    def trained(self, expr: relax.Expr) -> bool:
        """Whether ``expr`` depends on a parameter of the forward (past its inputs): a
        gradient would flow to it, which the op (no gradient for its mask) would drop."""
        if expr in self.depends:
            return self.depends[expr]
        self.depends[expr] = False  # (a cycle guard; the forward has none)
        if expr in self.weights:
            self.depends[expr] = True
        elif isinstance(expr, relax.Var) and expr in self.uses.value:
            self.depends[expr] = any(
                self.trained(o) for o in relax.analysis.free_vars(self.uses.value[expr]))
        return self.depends[expr]

    def scalar(self, expr: relax.Expr) -> Optional[float]:
        if isinstance(expr, relax.Var) and isinstance(self.uses.value.get(expr),
                                                      tvm.ir.expr.Constant):
            expr = self.uses.value[expr]  # a constant bound to a variable (masked_fill's fill)
        if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1:
            return float(expr.value.numpy().reshape(()))
        return None

    def match(self, call: relax.Call) -> Optional[relax.Expr]:
        """The attention op replacing the product ``call`` (O = P @ v), or None."""
        probs, v = self.source(call.args[0]), self.source(call.args[1])
        softmax = self.bound(probs, "relax.nn.softmax")
        if softmax is None or len(_shape(probs)) != 4 or len(_shape(v)) != 4:
            return None
        if int(softmax.attrs.axis) not in (-1, 3):
            return None
        scores, mask, scale = softmax.args[0], None, 1.0
        add = self.bound(scores, "relax.add")
        if add is not None:
            scores, mask = add.args
        else:  # masked_fill: where(cond, fill, S) or where(cond, S, fill)
            where = self.bound(scores, "relax.where")
            if where is not None:
                cond, a, b = where.args
                fill_a, fill_b = self.scalar(a), self.scalar(b)
                if (fill_a is None) == (fill_b is None):
                    return None
                scores = b if fill_a is not None else a
                fill = fill_a if fill_a is not None else fill_b
                assert fill is not None
                mask = _FillMask(cond, fill, fill_a is not None, str(scores.ty.dtype))
        for op, inverse in (("relax.multiply", False), ("relax.divide", True)):
            scaled = self.bound(scores, op)
            c = self.scalar(scaled.args[1]) if scaled is not None else None
            if scaled is not None and c:
                scores, scale = scaled.args[0], (1.0 / c if inverse else c)
                break
        product = self.bound(scores, "relax.reshape")
        product = self.bound(product.args[0], "relax.matmul") if product is not None else None
        if product is None:
            return None
        q, kt = self.source(product.args[0]), self.source(product.args[1])
        transpose = self.bound(kt, "relax.permute_dims", once=False)
        if transpose is None or [int(a) for a in transpose.attrs.axes] != [0, 1, 3, 2]:
            return None
        k = transpose.args[0]
        if len(_shape(q)) != 4 or len(_shape(k)) != 4 or str(q.ty.dtype) != str(
                probs.ty.dtype):
            return None
        # the scores are q's rows against k's: (B, H, Tq, Tk), and v has Tk rows
        if (_shape(probs) != _shape(q)[:3] + (_shape(k)[2],)
                or _shape(v)[:3] != _shape(k)[:3]):
            return None
        if isinstance(mask, _FillMask):
            return attention(q, k, v, None, causal=False, scale=scale), mask
        if mask is not None and not (isinstance(mask.ty, relax.TensorType)
                                     and str(mask.ty.dtype).startswith(("float", "bfloat"))
                                     and not self.trained(mask)):
            return None  # a learned bias (relative positions, ALiBi) needs its gradient
        try:
            return attention(q, k, v, mask, causal=False, scale=scale), None
        except ValueError:  # operands the op does not take: left as they are
            return None


class _FillMask:
    """A mask written as masked_fill: ``fill`` where ``cond`` is true (``fill_when_true``),
    else where it is false; 0 elsewhere."""

    def __init__(self, cond: relax.Expr, fill: float, fill_when_true: bool, dtype: str) -> None:
        self.cond, self.fill, self.when, self.dtype = cond, fill, fill_when_true, dtype

    def value(self, cond: np.ndarray) -> np.ndarray:
        hit = cond if self.when else ~cond
        return np.where(hit, np.float32(self.fill), np.float32(0.0))

    def expr(self, cond: relax.Expr) -> relax.Expr:
        fill, zero = relax.const(self.fill, self.dtype), relax.const(0.0, self.dtype)
        return relax.op.where(cond, fill, zero) if self.when else relax.op.where(cond, zero,
                                                                                 fill)


#: an additive mask value at or below this is "masked": exp underflows to 0 in every dtype
MASKED = -1e4


def _static_value(var: relax.Expr, uses: _Uses) -> Optional[np.ndarray]:
    """The value of ``var`` when it is computed from constants alone (its bindings compiled
    and run on the host), else None."""
    order: List[relax.Var] = []
    seen: Dict[relax.Var, bool] = {}

    def static(v: relax.Expr) -> bool:
        if not isinstance(v, relax.Var):
            return True
        if v in seen:
            return seen[v]
        value = uses.value.get(v)
        seen[v] = False  # a parameter, or a cycle guard while its operands are looked at
        if value is None:
            return False
        seen[v] = all(static(o) for o in relax.analysis.free_vars(value))
        if seen[v]:
            order.append(v)
        return seen[v]

    if isinstance(var, tvm.ir.expr.Constant):  # a buffer bound as a constant
        return var.value.numpy()
    if not isinstance(var, relax.Var) or not static(var):
        return None
    # the bindings as they are (in the forward's order), then ``var`` as the output
    out = relax.Var("static_value", var.ty)
    block = relax.DataflowBlock([relax.VarBinding(v, uses.value[v]) for v in order]
                                + [relax.VarBinding(out, var)])
    func = relax.Function([], relax.SeqExpr([block], out), var.ty).with_attr(
        "global_symbol", "static_value")
    # the same mask comes with every capture of a model (each batch size, each test): its
    # value is remembered by the computation's structure, so it compiles once per process
    key = tvm_ffi.structural_hash(func)
    cached = _STATIC_VALUES.get(key)
    if cached is None or not tvm_ffi.structural_equal(cached[0], func):
        executable = tvm.compile(tvm.IRModule({"static_value": func}), target="llvm")
        value = relax.VirtualMachine(executable, tvm.cpu())["static_value"]().numpy()
        cached = _STATIC_VALUES[key] = (func, value)
    return cached[1]


#: {structural hash: (the static computation, its value)} (``_static_value``)
_STATIC_VALUES: Dict[int, Tuple[relax.Function, np.ndarray]] = {}


def _is_causal(mask: np.ndarray, scores: Tuple[int, ...]) -> bool:
    """Whether an additive mask of the (..., T, T) ``scores`` is the causal one: 0 on and
    below the diagonal, <= MASKED above it, in every broadcast row (a mask broadcast along
    the query or key axis is not)."""
    if (mask.ndim < 2 or scores[-1] != scores[-2]
            or tuple(mask.shape[-2:]) != tuple(scores[-2:])):
        return False
    above = np.triu(np.ones(mask.shape[-2:], dtype=bool), 1)
    return bool(np.all(mask[..., ~above] == 0) and np.all(mask[..., above] <= MASKED))


@mutator
class _Fuse(PyExprMutator):
    def __init__(self, uses: _Uses, weights: FrozenSet[relax.Var]) -> None:
        super().__init__()
        self.matcher, self.fused, self.uses = _Matcher(uses, weights), 0, uses
        self.folded = 0  # captured attention ops whose mask is the causal one
        self.causal: Dict[Tuple[relax.Expr, Tuple[int, ...]], bool] = {}  # the causal mask

    def causal_mask(self, mask: relax.Expr, scores: Tuple[int, ...],
                    fill: Optional[_FillMask] = None) -> bool:
        key = (mask, scores)
        if key not in self.causal:
            value = _static_value(mask, self.uses)
            if value is not None and fill is not None:
                value = fill.value(value.astype(bool))
            self.causal[key] = value is not None and _is_causal(value, scores)
        return self.causal[key]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if is_attention(value) and has_mask(value):  # captured (SDPA) with a causal mask
            q, k, v, mask = value.args
            if self.causal_mask(mask, _shape(q)[:3] + (_shape(k)[2],)):
                new = attention(self.visit_expr(q), self.visit_expr(k), self.visit_expr(v),
                                None, causal=True, scale=float(value.attrs["scale"]) or None)
                self.set_var_remap(binding.var, self.builder_.emit(new))
                self.folded += 1
                return
        if _name(value) == "relax.matmul":
            found = self.matcher.match(value)
            if found is not None:  # on the operands as this mutator emitted them
                op, fill = found
                q, k, v, mask = op.args
                scores = _shape(q)[:3] + (_shape(k)[2],)
                scale = float(op.attrs["scale"])
                if fill is not None:
                    if self.causal_mask(fill.cond, scores, fill):
                        op = attention(q, k, v, None, causal=True, scale=scale)
                    else:
                        mask = self.builder_.emit(fill.expr(self.visit_expr(fill.cond)))
                        op = attention(q, k, v, mask, causal=False, scale=scale)
                elif has_mask(op) and self.causal_mask(mask, scores):
                    op = attention(q, k, v, None, causal=True, scale=scale)
                out = self.builder_.emit(relax.Call(
                    op.op, [self.visit_expr(a) for a in op.args], op.attrs))
                o = self.builder_.emit(relax.TupleGetItem(out, 0))
                viewed = relax.op.reshape(o, _shape(binding.var))
                self.set_var_remap(binding.var, self.builder_.emit(viewed))
                self.fused += 1
                return
        super().visit_var_binding_(binding)


def fuse_eager_attention(func: relax.Function) -> relax.Function:
    """``func`` with each eager attention it holds as the attention op (module docstring)."""
    uses = _Uses()
    uses.visit_expr(func)
    inputs = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else 0
    fuse = _Fuse(uses, frozenset(func.params[inputs:]))
    fused = fuse.visit_expr(func)
    out = (relax.analysis.remove_all_unused(fused) if fuse.fused or fuse.folded
           else func)
    left = sum(1 for v in uses.value.values()
               if _name(v) == "relax.nn.softmax" and len(_shape(v)) == 4)
    if left > fuse.fused:
        _LOG.info("eager attention: %d of %d softmaxes over 4-d scores kept on the T x T path "
                  "(not softmax(q k^T * c + mask) @ v read once: dropout on the "
                  "probabilities, or the weights returned)", left - fuse.fused, left)
    return out
