"""Cross-entropy as one op with its own backward: ``raf_dist.cross_entropy(logits, target)``
is the mean over the rows of ``logsumexp(logits[r]) - logits[r, target[r]]`` (logits
``(..., C)`` of any float dtype, integer targets ``(...)``); its gradient
``raf_dist.cross_entropy_grad(logits, target, g)`` writes ``(softmax(logits[r]) -
one_hot(target[r])) * g / rows`` straight into a tensor of the logits' dtype.

Why not ``log_softmax`` + ``nll_loss`` (what training/loss.py emitted before): autodiff of
that pair holds four logits-sized float32 tensors across the loss (the log-probabilities, the
nll gradient's mostly-zero tensor, the log-softmax gradient, and under mixed precision the
logits widened to float32 and the gradient narrowed back), and TVM's nll_loss backward is an
opaque kernel nothing fuses into. Here the forward keeps nothing but the logits (which the
backward recomputes the row statistics from: two more reads of one tensor, no write), and
the backward writes one tensor, in the logits' dtype. Under bf16 the logits leave the head
matmul in bf16 and never exist in float32 (``narrow_loss_input``): the statistics are
accumulated in float32 registers. This is the fused cross-entropy of Megatron-LM's
``fused_vocab_parallel_cross_entropy`` and of Liger-Kernel / Apex's ``xentropy`` (same
formula; written here as TE, so it is lowered for the CPU and CUDA like any other op).

Targets are checked to lie in [0, C) before a step runs (loss.check_targets), so the mean is
over every row, as ``torch.nn.functional.cross_entropy``'s with no ``ignore_index`` hit.
"""
import math
from typing import Any, List, Tuple

import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.relax.op.base import register_gradient
from tvm.relax.transform.legalize_ops.common import register_legalize

from ..ir.attrs import LONG_ROW, MATERIALIZE, VECTOR_LANES
from ..ir.ops import CROSS_ENTROPY, CROSS_ENTROPY_GRAD, GRADIENT_LEVEL, register_op
from ..passes.auto_cast import LOW_DTYPES
from ..passes.fast_math import softmax_stages

_FORWARD = register_op(
    CROSS_ENTROPY, "mean cross-entropy of logits (..., C) against integer targets (...)",
    arguments=[("logits", "the unnormalised scores, classes last"),
               ("target", "class indices in [0, C)")],
    infer=lambda call, ctx: relax.TensorType((), "float32"))
_BACKWARD = register_op(
    CROSS_ENTROPY_GRAD, "the gradient of raf_dist.cross_entropy with respect to its logits",
    arguments=[("logits", "the forward's logits"), ("target", "the class indices"),
               ("output_grad", "the loss's gradient (0-d float32)")])


def cross_entropy(logits: relax.Expr, target: relax.Expr) -> relax.Call:
    return relax.Call(_FORWARD, [logits, target])


def is_cross_entropy(expr: relax.Expr) -> bool:
    return isinstance(expr, relax.Call) and expr.op == _FORWARD


def _gradient(var: relax.Var, call: relax.Call, grad: relax.Expr,
              ctx: Any) -> List[relax.Expr]:
    logits, target = call.args
    return [relax.Call(_BACKWARD, [logits, target, grad]), relax.op.grad.no_grad(target)]


register_gradient(CROSS_ENTROPY, _gradient, level=GRADIENT_LEVEL)


# ---- lowering (TE): the row statistics in float32 whatever the logits' dtype ----

def _row_statistics(logits: te.Tensor) -> Tuple[List[Any], te.Tensor, te.Tensor, te.Tensor]:
    """(rows shape, the row max, exp(x - row max), the row sum of it): fast_math's softmax
    stages (the exp materialised, so its block is vectorised; in compiler/schedule.py's
    row-fused schedule it is one row per thread, not a logits-sized buffer) over the logits,
    or over a float32 copy of them: exp_float32's Let bindings over a bfloat16 load are left
    in 16 bits by TVM's BF16ComputeLegalize (measured: every row's sum came out inf), so
    16-bit logits are widened in a materialised block of their own first.

    A long row the vector lanes do not divide (GPT-2's 50257 classes; LONG_ROW) is widened
    too, to the next multiple of the lanes, the padding -inf (no effect on the max; exp gives
    0 to the sum): the statistics then run on whole vectors in the row-fused schedule.
    Unpadded, the schedule could not fuse the rows (odd rows are left to per-block
    schedules), so its reductions were scalar loops over logits-sized intermediates: GPT-2
    124M's loss and its gradient took 146 + 149 ms of a 1.1 s bf16 step."""
    columns = int(logits.shape[-1])
    padded = columns % VECTOR_LANES != 0 and columns >= LONG_ROW  # shorter: as they are
    width = -(-columns // VECTOR_LANES) * VECTOR_LANES if padded else columns
    source = logits
    if logits.dtype != "float32" or padded:
        def widened(*index: Any) -> Any:
            *row, c = index
            if not padded:
                return logits(*index).astype("float32")
            # clamped: the padding's read stays inside the row, and its value is discarded
            value = logits[tuple(row) + (te.min(c, columns - 1),)].astype("float32")
            return tvm.tirx.Select(c < columns, value, tvm.tirx.const(-math.inf, "float32"))

        source = te.compute(list(logits.shape)[:-1] + [width], widened, name="ce_widened",
                            attrs={MATERIALIZE: 1})
    row_max, exp, row_sum, _ = softmax_stages(source, -1)
    return list(logits.shape)[:-1], row_max, exp, row_sum


def _per_row_te(logits: te.Tensor, target: te.Tensor) -> te.Tensor:
    """Each row's loss, ``log(sum(exp(x - max))) + max - x[target]``, as (rows..., 1): an
    output with a unit last axis is row-wise to compiler/schedule.py, so the statistics'
    blocks are computed one row at a time. The target's logit is read from ``logits``
    itself, not from the widened copy: a data-dependent read of that block gives compute_at
    a region without bounds (TVM's InverseAffineIterMap fails on some row shapes — (16, 64,
    4096) in bf16 — and the whole kernel was left serial)."""
    rows, row_max, _, row_sum = _row_statistics(logits)

    def loss(*index: Any) -> Any:
        i = index[:-1]
        picked = logits[tuple(i) + (target(*i).astype("int64"),)].astype("float32")
        return te.log(row_sum(*i)) + row_max(*i) - picked

    return te.compute(rows + [1], loss, name="ce_per_row")


def _backward_te(logits: te.Tensor, target: te.Tensor, output_grad: te.Tensor) -> te.Tensor:
    rows, _, exp, row_sum = _row_statistics(logits)
    scale = tvm.tirx.const(1.0 / math.prod(int(d) for d in rows), "float32")

    def grad(*index: Any) -> Any:
        i, c = index[:-1], index[-1]
        hot = tvm.tirx.Select(c.astype("int64") == target(*i).astype("int64"),
                              tvm.tirx.const(1.0, "float32"), tvm.tirx.const(0.0, "float32"))
        value = (exp(*index) / row_sum(*i) - hot) * (output_grad() * scale)
        return value if logits.dtype == "float32" else value.astype(logits.dtype)

    return te.compute(logits.shape, grad, name="cross_entropy_grad")


def _legalize_forward(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """The rows' losses as one row-fused kernel, then TVM's mean (a reduction to one value
    compiler/schedule.py already spreads over the cores)."""
    per_row = bb.emit(bb.call_te(_per_row_te, call.args[0], call.args[1],
                                 primfunc_name_hint="cross_entropy_rows"))
    return relax.op.mean(per_row)


register_legalize(CROSS_ENTROPY, _legalize_forward)
register_legalize(CROSS_ENTROPY_GRAD, lambda bb, call: bb.call_te(
    _backward_te, call.args[0], call.args[1], call.args[2],
    primfunc_name_hint="cross_entropy_grad"))


# ---- the loss reads the head's 16-bit logits ----

def narrow_loss_input(func: relax.Function) -> relax.Function:
    """``cross_entropy(astype(x, "float32"), t)`` with ``x`` bf16 / fp16 (AutoCast's cast of
    the forward's output back to float32) becomes ``cross_entropy(x, t)``: the op computes
    its statistics in float32 itself, so the widened logits are never written and, after
    autodiff, the logits' gradient is made in the 16-bit dtype the head's matmul backward
    reads (no float32 gradient narrowed by a cast). The cast stays when anything else reads
    the float32 logits. ``func``: a forward with its loss appended (AppendLoss's output)."""
    narrowed = _Narrow().visit_expr(func)
    return relax.analysis.remove_all_unused(narrowed)


_ASTYPE = tvm.ir.Op.get("relax.astype")


@mutator
class _Narrow(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_cross_entropy(call) or not isinstance(call.args[0], relax.Var):
            return call
        cast = self.lookup_binding(call.args[0])
        while isinstance(cast, relax.Var):  # AppendLoss binds the forward's output to a var
            cast = self.lookup_binding(cast)
        if (isinstance(cast, relax.Call) and cast.op == _ASTYPE
                and str(cast.args[0].ty.dtype) in LOW_DTYPES):
            return cross_entropy(cast.args[0], call.args[1])
        return call
