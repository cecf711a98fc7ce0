"""raf_dist's custom Relax ops and markers (DESIGN.md sections 3b, 3c).

Registered ops (identity-like, one tensor in, with a gradient, so TVM's Gradient pass emits
the backward by itself):

- ``raf_dist.tp_copy`` (Megatron's f, ``copy_to_tensor_model_parallel_region``): identity
  forward; its gradient is ``tp_reduce`` of the output gradient.
- ``raf_dist.tp_reduce`` (Megatron's g): allreduce (sum) over the tp group forward, identity
  backward.
- ``raf_dist.tp_max``: allreduce (max) over the tp group, no gradient (the softmax's shift of
  the vocabulary-parallel cross-entropy).
- ``raf_dist.tp_rank(x)``: this rank's position in the tp group, a 0-d int64 tensor (the
  IR stays the same on every rank; the runtime answers, ``TP_RANK_FUNC``).
- ``raf_dist.pipeline_stage`` / ``raf_dist.pipeline_stage_grad``: a pipeline stage boundary
  in the forward and its mirror in the backward (identity; each the other's gradient).
- ``raf_dist.ep_exchange(x)`` (attributes ``send``, ``recv``: rows per rank of the dp group):
  the personalised all-to-all of embedding-table parallelism (passes/embedding_parallel.py):
  rows ``[sum(send[:j]), sum(send[:j + 1]))`` of ``x`` go to rank j, and the result holds
  ``recv[j]`` rows from each rank j in rank order. Its gradient is the reverse exchange
  (``send`` and ``recv`` swapped).

Markers (``R.call_pure_packed(symbol, x, R.prim_value(i))``, rewritten by a pass before
lowering):

- ``raf_dist.dropout`` (the i-th dropout, in execution order; frontend/dropout.py);
- ``raf_dist.mark_gradient`` ("this is the gradient of parameter i": the contract between the
  step builder and the distribution passes; passes/gradient_markers.py).
"""
import tvm
from tvm import relax
from tvm.ir import _ffi_api as _ir_api
from tvm.relax.op.base import register_gradient

from .utils import is_packed_marker

TP_COPY = "raf_dist.tp_copy"
TP_REDUCE = "raf_dist.tp_reduce"
TP_MAX = "raf_dist.tp_max"
TP_RANK = "raf_dist.tp_rank"
#: the runtime function a lowered tp_rank calls: (like, group) -> 0-d int64 tensor
TP_RANK_FUNC = "raf_dist.tp_rank_tensor"
STAGE_MARKER = "raf_dist.pipeline_stage"
STAGE_MARKER_GRAD = "raf_dist.pipeline_stage_grad"
EP_EXCHANGE = "raf_dist.ep_exchange"
#: the runtime function of a sharded table's sparse SGD update (runtime/embedding_update.py):
#: (table, ids, rows' gradients, lr, keep) -> the table, updated in place
EMBEDDING_SGD_ROWS = "raf_dist.embedding.sgd_rows"
#: (Adagrad) (sum, ids, rows' gradients, keep, row_wise) -> sum: the looked-up rows'
#: accumulators, in place; then (table, sum, ids, rows, clr, eps, keep) -> the table, in place
EMBEDDING_ADAGRAD_SUM = "raf_dist.embedding.adagrad_sum"
EMBEDDING_ADAGRAD_ROWS = "raf_dist.embedding.adagrad_rows"
#: (ids, rows' gradients) -> 0-d float32: the sum of squares of the table gradient they
#: make (duplicates summed first), for clipping a sparsely updated table
EMBEDDING_ROWS_SQUARES = "raf_dist.embedding.rows_squares"
#: the sparse row updates, each writing its first argument in place
EMBEDDING_ROW_UPDATES = (EMBEDDING_SGD_ROWS, EMBEDDING_ADAGRAD_SUM, EMBEDDING_ADAGRAD_ROWS)
#: where each row update takes its ``keep`` flag (0-based, among the call's arguments):
#: ShardZeRO's guard puts every rank's finite verdict there
EMBEDDING_ROW_KEEP = {EMBEDDING_SGD_ROWS: 4, EMBEDDING_ADAGRAD_SUM: 3, EMBEDDING_ADAGRAD_ROWS: 6}
#: the fused cross-entropy and its gradient (training/cross_entropy.py registers them)
CROSS_ENTROPY = "raf_dist.cross_entropy"
CROSS_ENTROPY_GRAD = "raf_dist.cross_entropy_grad"
#: scaled-dot-product attention as one op and its gradient (ir/attention.py)
ATTENTION = "raf_dist.attention"
ATTENTION_GRAD = "raf_dist.attention_grad"
#: the host kernels they lower to (runtime/attention_kernels.py): (q, k, v, mask, causal,
#: scale) -> (output, log-sum-exp); (dO, q, k, v, O, L, mask, causal, scale) -> (dq, dk, dv)
ATTENTION_FORWARD_KERNEL = "raf_dist.attention.forward"
ATTENTION_BACKWARD_KERNEL = "raf_dist.attention.backward"
#: layer norm's input and scale gradients, one row-wise kernel each (training/layer_norm.py)
LAYER_NORM_GRAD = "raf_dist.layer_norm_grad"
LAYER_NORM_GRAD_WEIGHT = "raf_dist.layer_norm_grad_weight"
DROPOUT_MARKER = "raf_dist.dropout"
MARK_GRADIENT = "raf_dist.mark_gradient"
#: a planned temporary's tensor at a byte offset into the step's arena (src/ccl/bucket.cc,
#: compiler/share_storage.py)
ARENA_VIEW = "raf_dist.arena.view"

#: the level raf_dist registers gradients at: above TVM's own registrations (level 10)
GRADIENT_LEVEL = 11


def gradient(name, level=GRADIENT_LEVEL):
    """Decorator: register the function as the gradient of the Relax op ``name``
    (``fn(orig_var, orig_call, output_grad, ctx) -> [one partial per argument]``)."""
    def wrap(fn):
        register_gradient(name, fn, level=level)
        return fn

    return wrap


def register_op(name, description, gradient=None, infer=None, argument="the tensor",
                arguments=None):
    """Register the Relax op ``name`` (pure; type: ``infer(call, ctx)``, default its first
    input's) with ``gradient(var, call, grad, ctx) -> [one partial per argument]``: one
    tensor ``x`` described by ``argument``, or ``arguments`` = [(name, description), ...].
    Registering again (a module reloaded) returns the op already there."""
    if name in _ir_api.ListOpNames():
        return tvm.ir.Op.get(name)
    _ir_api.RegisterOp(name, description)
    op = tvm.ir.Op.get(name)
    arguments = arguments or [("x", argument)]
    op.set_num_inputs(len(arguments))
    for arg_name, text in arguments:
        op.add_argument(arg_name, "Tensor", text)
    tvm.ir.register_op_attr(name, "FInferType", infer or (lambda call, ctx: call.args[0].ty))
    tvm.ir.register_op_attr(name, "FPurity", True)
    tvm.ir.register_op_attr(name, "TScriptPrinterName", name)
    if gradient is not None:
        register_gradient(name, gradient, level=GRADIENT_LEVEL)
    return op


def _exchange_type(call, ctx):
    """The rows ``call.attrs["recv"]`` add up to, each of the input's row shape."""
    x = call.args[0]
    rows = sum(int(r) for r in call.attrs["recv"])
    return relax.TensorType([rows] + [int(d) for d in list(x.ty.shape)[1:]], x.ty.dtype)


def _exchange_attrs(send, recv):
    return tvm.ir.make_node("ir.DictAttrs", send=[int(r) for r in send],
                            recv=[int(r) for r in recv])


_OPS = {  # name -> registered op (the gradients refer to each other through this table)
    TP_COPY: register_op(TP_COPY, "identity forward, allreduce(sum) over the tp group backward",
                         gradient=lambda var, call, grad, ctx: [relax.Call(_OPS[TP_REDUCE],
                                                                           [grad])]),
    TP_REDUCE: register_op(TP_REDUCE, "allreduce(sum) over the tp group forward, identity "
                           "backward", gradient=lambda var, call, grad, ctx: [grad]),
    TP_MAX: register_op(TP_MAX, "allreduce(max) over the tp group forward, no gradient",
                        gradient=lambda var, call, grad, ctx: [relax.op.zeros_like(grad)]),
    TP_RANK: register_op(TP_RANK, "this rank's index in the tp group (0-d int64)",
                         infer=lambda call, ctx: relax.TensorType((), "int64"),
                         gradient=lambda var, call, grad, ctx: [
                             relax.op.zeros_like(call.args[0])]),
    STAGE_MARKER: register_op(
        STAGE_MARKER, "pipeline stage boundary (identity)",
        gradient=lambda var, call, grad, ctx: [relax.Call(_OPS[STAGE_MARKER_GRAD], [grad])],
        argument="the activation crossing the stage boundary"),
    STAGE_MARKER_GRAD: register_op(
        STAGE_MARKER_GRAD, "the stage boundary in the backward (identity)",
        gradient=lambda var, call, grad, ctx: [relax.Call(_OPS[STAGE_MARKER], [grad])],
        argument="the activation crossing the stage boundary"),
    EP_EXCHANGE: register_op(
        EP_EXCHANGE, "all-to-all of rows over the dp group (embedding-table parallelism)",
        infer=_exchange_type, argument="the rows to send, in destination-rank order",
        gradient=lambda var, call, grad, ctx: [relax.Call(
            _OPS[EP_EXCHANGE], [grad], attrs=_exchange_attrs(call.attrs["recv"],
                                                             call.attrs["send"]))]),
}
_TP_OPS = tuple(_OPS[n] for n in (TP_COPY, TP_REDUCE, TP_MAX, TP_RANK))


def _op(name):
    return _OPS[name]


# ---- tensor parallelism -------------------------------------------------------------------
def tp_copy(x):
    """f: the replicated input ``x`` of a tensor-parallel region."""
    return relax.Call(_op(TP_COPY), [x])


def tp_reduce(x):
    """g: the sum over the tp ranks of their partial results ``x``."""
    return relax.Call(_op(TP_REDUCE), [x])


def tp_max(x):
    """The elementwise max over the tp ranks of ``x`` (no gradient)."""
    return relax.Call(_op(TP_MAX), [x])


def tp_rank(like):
    """This rank's index in the tp group, a 0-d int64 tensor on ``like``'s device."""
    return relax.Call(_op(TP_RANK), [like])


def is_tp_op(expr, which=None):
    """True for a call of one of the tp ops (or of ``which`` only)."""
    ops = _TP_OPS if which is None else (_OPS[which],)
    return isinstance(expr, relax.Call) and any(expr.op.same_as(op) for op in ops)


# ---- pipeline stages ----------------------------------------------------------------------
def stage_boundary(x):
    """A stage boundary after ``x`` (a Relax expression): the next stage starts here."""
    return relax.Call(_op(STAGE_MARKER), [x])


def is_stage_marker(expr, backward=False):
    op = _op(STAGE_MARKER_GRAD if backward else STAGE_MARKER)
    return isinstance(expr, relax.Call) and expr.op.same_as(op)


# ---- embedding-table parallelism ----------------------------------------------------------
def ep_exchange(x, send, recv):
    """The all-to-all of ``x``'s rows over the dp group: ``send[j]`` rows to rank j (in
    order), ``recv[j]`` rows from rank j (module docstring)."""
    if sum(int(r) for r in send) != int(x.ty.shape[0]):
        raise ValueError(f"ep_exchange sends {sum(send)} rows of a tensor of "
                         f"{int(x.ty.shape[0])}")
    return relax.Call(_op(EP_EXCHANGE), [x], attrs=_exchange_attrs(send, recv))


def is_ep_exchange(expr):
    return isinstance(expr, relax.Call) and expr.op.same_as(_op(EP_EXCHANGE))


# ---- markers ------------------------------------------------------------------------------
def dropout_marker(x, index):
    """The ``index``-th dropout of the forward, applied to ``x``."""
    return relax.call_pure_packed(DROPOUT_MARKER, x, relax.prim_value(int(index)), ty_args=x.ty)


def mark_gradient(grad, param_index):
    """``grad`` is the gradient of parameter ``param_index``; the optimizer reads the result."""
    return relax.call_pure_packed(MARK_GRADIENT, grad, relax.prim_value(int(param_index)),
                                  ty_args=grad.ty)


def is_gradient_marker(expr):
    return is_packed_marker(expr, MARK_GRADIENT)


def custom_op_names():
    """The names of raf_dist's registered ops (all identity-like or collectives of one
    tensor: mixed precision lets them follow their input's dtype)."""
    return frozenset(_OPS)
