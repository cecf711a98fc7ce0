"""Mixed precision's saved values: the backward of a bf16 / fp16 step reads the 16-bit copy of
a forward value where the forward made one, so the float32 value dies in the forward.

AutoCast (passes/auto_cast.py) leaves two kinds of float32 forward values that TVM's Gradient
then keeps alive from the forward to their backward use, beside a 16-bit twin:

- **widened**: ``v = astype(u, "float32")`` of a 16-bit forward value ``u`` (the residual
  stream widened for a layer norm, whose backward reads its input), or a reshape of one. The backward reads
  ``astype(u, "float32")`` recomputed right before its first use instead: the same bits
  (widening is exact), half the bytes held (``u`` is kept instead of ``v``).
- **narrowed**: a float32 ``v`` whose 16-bit ``astype(v, low)`` the forward also computes
  (softmax's probabilities, made in float32 and narrowed for the value product). The backward
  reads the narrowed copy widened again: ``v`` itself dies in the forward and the 16-bit copy,
  which the product's backward keeps anyway, serves both. This rounds what the backward reads
  to the low precision, as Megatron-LM's fused softmax kernels do (they save their output in
  fp16 / bf16); PyTorch's autocast keeps the float32 softmax output as well.

Only what the backward reads changes; the forward, the loss and every kept value are as
before. Runs on TVM's adjoint (one dataflow block, the forward's bindings first) before
recomputation, the step's markers and distribution."""
from typing import Dict, List, Optional, Tuple

import tvm
from tvm import relax

from ..ir.utils import op_name
from .gradient_markers import SubstituteVars

_ASTYPE = "relax.astype"


def _float_bits(var: relax.Expr) -> int:
    ty = getattr(var, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.dtype is None:
        return 0
    dtype = tvm.DataType(str(ty.dtype))
    return int(dtype.bits) if dtype.type_code in (tvm.DataTypeCode.FLOAT,
                                                  tvm.DataTypeCode.BFLOAT) else 0


def _sources(forward: List[relax.Binding], narrowed: bool) -> Dict[relax.Var, Tuple[relax.Var, str]]:
    """{float32 forward value: (the 16-bit forward value it is read from instead, dtype)}."""
    producer = {b.var: b.value for b in forward}
    defined = set(producer)
    out: Dict[relax.Var, Tuple[relax.Var, str]] = {}
    for binding in forward:
        value = binding.value
        if op_name(value) != _ASTYPE or not isinstance(value.args[0], relax.DataflowVar):
            continue
        src, dst = value.args[0], binding.var
        if src not in defined or not isinstance(dst, relax.DataflowVar):
            continue
        src_bits, dst_bits = _float_bits(src), _float_bits(dst)
        if not src_bits or not dst_bits:
            continue
        if src_bits < dst_bits:  # widened: exact
            out[dst] = (src, str(dst.ty.dtype))
        elif narrowed and src_bits > dst_bits:
            # the value narrowed, and what it was reshaped or broadcast (to its own shape) from
            for same in _same_values(src, producer):
                out.setdefault(same, (dst, str(src.ty.dtype)))
    # a reshape of a widened value is widened too (GPT-2's gelu_new reads its input as
    # reshape(astype(x, "float32")) for power's gradient: 6.3 MB a layer held in float32)
    for binding in forward:
        value, var = binding.value, binding.var
        if (isinstance(value, relax.Call) and op_name(value) == "relax.reshape"
                and value.args[0] in out and var not in out and isinstance(var, relax.DataflowVar)
                and _keeps_values(value, var)):
            low, dtype = out[value.args[0]]
            if _float_bits(low) < _float_bits(var):
                out[var] = (low, dtype)
    return out


def _same_values(var: relax.Var, producer: Dict[relax.Var, relax.Expr]) -> List[relax.Var]:
    """``var`` and the forward values it is a reshape, a same-shape broadcast or an alias of
    (the softmax probabilities reach their narrowing cast through a broadcast_to)."""
    chain = [var]
    while True:
        value = producer.get(chain[-1])
        if isinstance(value, relax.DataflowVar):
            source = value
        elif isinstance(value, relax.Call) and _keeps_values(value, chain[-1]):
            source = value.args[0]
        else:
            return chain
        if not isinstance(source, relax.DataflowVar) or source not in producer:
            return chain
        chain.append(source)


def _keeps_values(call: relax.Call, out: relax.Var) -> bool:
    """Whether ``call`` (producing ``out``) only reshapes its first argument, or broadcasts it
    to its own shape."""
    op, shape = op_name(call), _shape(out)
    if shape is None:
        return False
    return op == "relax.reshape" or (op == "relax.broadcast_to" and _shape(call.args[0]) == shape)


def _shape(var: relax.Expr) -> Optional[Tuple[int, ...]]:
    """The static shape of ``var``, None when unknown or symbolic."""
    shape = getattr(getattr(var, "ty", None), "shape", None)
    if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def save_low_precision(adjoint: relax.Function, n_forward: int,
                       narrowed: bool = True) -> relax.Function:
    """``adjoint`` with its backward reading the 16-bit forward values (module docstring)."""
    if len(adjoint.body.blocks) != 1:
        raise ValueError("save_low_precision expects the adjoint as one dataflow block")
    bindings = list(adjoint.body.blocks[0].bindings)
    sources = _sources(bindings[:n_forward], narrowed)
    if not sources:
        return adjoint
    out = list(bindings[:n_forward])
    widened: Dict[relax.Var, relax.Var] = {}
    for binding in bindings[n_forward:]:
        mapping = {}
        for var in relax.analysis.free_vars(binding.value):
            if var not in sources:
                continue
            if var not in widened:
                low, dtype = sources[var]
                widened[var] = relax.DataflowVar(f"{var.name}_from_low", var.ty)
                value = relax.op.astype(low, dtype)
                if _shape(low) != _shape(var):  # read through a reshape
                    wide = relax.DataflowVar(f"{var.name}_from_low_flat",
                                             relax.TensorType(_shape(low), dtype))
                    out.append(relax.VarBinding(wide, value))
                    value = relax.op.reshape(wide, _shape(var))
                out.append(relax.VarBinding(widened[var], value))
            mapping[var] = widened[var]
        if mapping:
            binding = relax.VarBinding(binding.var,
                                       SubstituteVars(mapping).visit_expr(binding.value))
        out.append(binding)
    body = relax.SeqExpr([relax.DataflowBlock(out)], adjoint.body.body)
    func = relax.Function(adjoint.params, body, adjoint.ret_ty, adjoint.is_pure, adjoint.attrs)
    return relax.BlockBuilder().normalize(func)
