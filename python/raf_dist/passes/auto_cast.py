"""AutoCast: a forward function's compute in a low-precision float dtype (bfloat16 or
float16), float32 where range matters, float32 at its boundary (DESIGN.md section 1,
"Mixed precision").

Input: a Relax function (the model's forward, before autodiff) whose float tensors are
float32. Output: the same function where every call follows its op's cast rule:

- ``LOW`` (matmul, the convolutions and their transposes, einsum): float32 operands are cast
  to the low dtype, so the op and, after autodiff, its gradients run there;
- ``FLOAT32`` (softmax, log_softmax, exp, log, erf, power, sqrt/rsqrt, the reductions and
  normalisations whose statistics need range, the losses): low-precision operands are cast
  up to float32;
- ``FOLLOW`` (elementwise arithmetic, activations, data movement, comparisons, the raf_dist
  markers): when any float operand is low precision, the float32 ones are cast down (so the
  elementwise work between two matmuls stays in the low dtype), else nothing changes;
- ``KEEP`` (explicit casts, creation ops with a dtype, shape queries): left as written.

An op without a rule is an error naming it (a model must not silently train in float32 or,
worse, compute a softmax in bfloat16). Each (value, dtype) is cast once: a parameter used by
three matmuls is cast once per step, and the backward reuses that copy (the Gradient pass
differentiates ``astype`` into the cast back, so the parameter's gradient arrives float32:
the master weights and optimizer states stay float32). Every value that leaves the function
(the output the loss reads, new buffer values) is cast back to its original dtype, so the
loss runs in float32 and the function's signature is unchanged.

This is RAF's ``AutoCast`` (awslabs/raf ``src/pass/auto_cast.cc``: a cast rule per op and a
cast cache) written for Relax. TVM's own ``ToMixedPrecision`` is not used: it hard-codes
float16 and keeps the operands of every op it does not list in float32.
"""
from typing import Dict, List, Optional, Tuple

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir.context_parallel import CP_ATTENTION, CP_ATTENTION_GRAD, CP_POSITIONS
from ..ir.sequence_parallel import SP_OPS
from ..ir.ops import (ATTENTION, ATTENTION_GRAD, CROSS_ENTROPY, CROSS_ENTROPY_GRAD,
                      EP_EXCHANGE, LAYER_NORM_GRAD, LAYER_NORM_GRAD_WEIGHT, custom_op_names)
from ..ir.utils import mutate_functions

LOW_DTYPES = ("bfloat16", "float16")

LOW = frozenset(f"relax.{n}" for n in (
    "matmul", "einsum", "outer", "nn.conv1d", "nn.conv2d", "nn.conv3d", "nn.conv1d_transpose",
    "nn.conv2d_transpose", "nn.conv3d_transpose"))

FLOAT32 = frozenset(f"relax.{n}" for n in (
    "nn.softmax", "nn.log_softmax", "exp", "log", "erf", "power", "sqrt", "rsqrt",
    "sum", "mean", "variance", "std", "prod", "cumsum", "cumprod", "median", "log_add_exp",
    "nn.layer_norm", "nn.group_norm", "nn.batch_norm", "nn.instance_norm", "nn.rms_norm",
    "nn.cross_entropy_with_logits", "nn.nll_loss", "nn.softplus", "nn.attention",
    "nn.attention_bias", "nn.attention_var_len", "collapse_sum_like", "collapse_sum_to",
    "nn.adaptive_avg_pool1d", "nn.adaptive_avg_pool2d", "nn.adaptive_avg_pool3d",
    "nn.avg_pool1d", "nn.avg_pool2d", "nn.avg_pool3d", "tan", "sinh", "cosh", "asin",
    "acos", "atan", "atan2", "asinh", "acosh", "atanh", "grad.nll_loss_backward",
    "grad.avg_pool2d_backward",
    # TVM 0.27 cannot build these in bfloat16: isfinite / isinf / isnan (no 16-bit
    # finiteness ops), max_pool2d's gradient (a TIR type check fails)
    "isfinite", "isinf", "isnan",
    "nn.max_pool1d", "nn.max_pool2d", "nn.max_pool3d", "grad.max_pool2d_backward"))

FOLLOW = frozenset(f"relax.{n}" for n in (
    # arithmetic and activations
    "add", "subtract", "multiply", "divide", "negative", "abs", "maximum", "minimum",
    "floor_divide", "floor_mod", "mod", "square", "sign", "ceil", "floor", "round", "trunc",
    "clip", "ewise_fma", "tanh", "sigmoid", "sin", "cos", "nn.relu", "nn.gelu",
    "nn.gelu_tanh", "nn.silu", "nn.leakyrelu", "nn.prelu", "nn.selu", "nn.dropout",
    "max", "min", "argmax", "argmin", "grad.take_backward",
    # comparisons and selection
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "where",
    "logical_and", "logical_or", "logical_not", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "left_shift", "right_shift",
    "sort", "argsort", "topk",
    # data movement
    "reshape", "permute_dims", "expand_dims", "squeeze", "flatten", "nn.batch_flatten",
    "broadcast_to", "concat", "split", "stack", "strided_slice", "dynamic_strided_slice",
    "take", "gather_elements", "gather_nd", "scatter_elements", "scatter_nd", "index_put",
    "index_tensor", "slice_scatter", "tile", "repeat", "flip", "tril", "triu", "nn.pad",
    "nn.pixel_shuffle", "layout_transform", "one_hot", "zeros_like", "ones_like",
    "full_like", "image.resize2d", "grad.no_grad", "grad.start_checkpoint",
    "grad.end_checkpoint"))

KEEP = frozenset(f"relax.{n}" for n in (
    "astype", "zeros", "ones", "full", "arange", "eye", "eye_like", "shape_of",
    "shape_to_tensor", "tensor_to_shape", "size", "hint_on_device", "print", "assert_op",
    "null_value", "wrap_param"))

RULES = {**{n: "low" for n in LOW}, **{n: "float32" for n in FLOAT32},
         **{n: "follow" for n in FOLLOW}, **{n: "keep" for n in KEEP},
         # the fused loss reads 16-bit logits as they are (its statistics are float32 inside:
         # training/cross_entropy.py)
         CROSS_ENTROPY: "keep", CROSS_ENTROPY_GRAD: "keep",
         # attention computes in the low dtype with float32 statistics inside, its log-sum-exp
         # float32 (ir/attention.py); its gradient reads what the forward kept
         ATTENTION: "low", ATTENTION_GRAD: "keep",
         # context parallelism's (ir/context_parallel.py): the same, and the positions
         CP_ATTENTION: "low", CP_ATTENTION_GRAD: "keep", CP_POSITIONS: "keep",
         # sequence parallelism's exchanges (ir/sequence_parallel.py) carry their input's dtype
         **{n: "follow" for n in SP_OPS},
         # layer norm's fused backward (training/layer_norm.py), float32 as the forward's norm
         LAYER_NORM_GRAD: "keep", LAYER_NORM_GRAD_WEIGHT: "keep"}


#: raf_dist's embedding-table exchange (passes/embedding_parallel.py) is an all-to-all whose
#: two sides are different IR: a holder sends what it computed (pooled bags: a matmul, so low
#: precision), the others an empty block of the table's rows. Following the input would give
#: the sides different dtypes (MPI fails on the mismatch), so the exchange carries float32 on
#: every rank, as torchrec's pooled all-to-all does unless quantized comms are asked for.
FLOAT32_EXCHANGES = frozenset({EP_EXCHANGE})


def rule_of(op_name: str) -> str:
    """The cast rule of the op named ``op_name``; raf_dist's own ops (markers, tp
    collectives) follow their inputs, the embedding exchange is float32. Raises for an op
    without a rule."""
    if op_name in FLOAT32_EXCHANGES:
        return "float32"
    rule = RULES.get(op_name)
    if rule is None and op_name in custom_op_names():
        rule = "follow"
    if rule is None:
        raise NotImplementedError(
            f"mixed precision: the op {op_name} has no cast rule (passes/auto_cast.py: LOW, "
            "FLOAT32, FOLLOW or KEEP); add it to the set it belongs to, or train this model "
            "with precision='fp32'")
    return rule


def _float_dtype(expr: relax.Expr) -> Optional[str]:
    ty = expr.ty
    if isinstance(ty, relax.TensorType) and ty.dtype in ("float32", *LOW_DTYPES):
        return str(ty.dtype)
    return None


class _Caster:
    """Emits a function's bindings again with casts, into ``bb`` (module docstring)."""

    def __init__(self, bb: relax.BlockBuilder, low: str) -> None:
        self.bb, self.low = bb, low
        self.values: Dict[relax.Var, relax.Expr] = {}  # old var -> its new value
        self.bound: Dict[relax.Var, relax.Expr] = {}  # new var -> the value emitted for it
        self.casts: Dict[Tuple[relax.Expr, str], relax.Expr] = {}  # the cast cache

    def emit(self, value: relax.Expr, name: str) -> relax.Var:
        var = self.bb.emit(value, name_hint=name)
        self.bound[var] = value
        return var

    def cast(self, expr: relax.Expr, dtype: str) -> relax.Expr:
        """``expr`` in ``dtype``, cast once. A cast of a view (``permute_dims`` / reshape of
        one tensor, e.g. a weight transposed for a matmul) is made under the view, so the
        view is still one DispatchToBLAS folds into a transpose flag."""
        if _float_dtype(expr) in (None, dtype):
            return expr
        key = (expr, dtype)
        if key not in self.casts:
            hint = expr.name if isinstance(expr, relax.Var) else "c"
            view = self.bound.get(expr) if isinstance(expr, relax.Var) else None
            if (isinstance(view, relax.Call) and isinstance(view.op, tvm.ir.Op)
                    and view.op.name in _VIEWS):
                value = relax.Call(view.op, [self.cast(view.args[0], dtype), *view.args[1:]],
                                   view.attrs, view.ty_args)
            else:
                value = relax.op.astype(expr, dtype)
            self.casts[key] = self.emit(value, f"{hint}_{dtype}")
        return self.casts[key]

    def remap(self, expr: relax.Expr) -> relax.Expr:
        """``expr`` with the variables bound in this function replaced by their new values."""
        if isinstance(expr, relax.Var):
            return self.values.get(expr, expr)
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self.remap(f) for f in expr.fields])
        if isinstance(expr, relax.TupleGetItem):
            return relax.TupleGetItem(self.remap(expr.tuple_value), expr.index)
        if isinstance(expr, relax.Call):
            return relax.Call(expr.op, [self.remap(a) for a in expr.args], expr.attrs,
                              expr.ty_args)
        return expr  # constants, shapes, prim values, strings

    def call(self, call: relax.Call) -> relax.Expr:
        """``call`` (already remapped) with its operands cast by its op's rule."""
        if not isinstance(call.op, tvm.ir.Op):
            raise NotImplementedError(f"mixed precision: a call of {call.op} (not an op) in "
                                      "the forward has no cast rule")
        rule = rule_of(call.op.name)
        if rule == "keep":
            return call
        operands = _operands(call.args)
        dtypes = {_float_dtype(a) for a in operands} - {None}
        if rule == "low":
            target = self.low
        elif rule == "float32":
            target = "float32"
        elif dtypes & set(LOW_DTYPES):  # follow: low precision when an operand is
            target = self.low
        else:
            return call
        args = [relax.Tuple([self.cast(f, target) for f in a.fields])
                if isinstance(a, relax.Tuple) else self.cast(a, target) for a in call.args]
        attrs = call.attrs
        if rule == "low" and attrs is not None and hasattr(attrs, "out_dtype"):
            attrs = _without_out_dtype(attrs)  # the importer writes out_dtype="float32"
        return relax.Call(call.op, args, attrs, call.ty_args)

    def restore(self, value: relax.Expr, original: relax.Type) -> relax.Expr:
        """``value`` (emitted) cast back to the dtypes of ``original`` (tuples field by field)."""
        if isinstance(original, relax.TupleType):
            fields = [self.restore(self.emit(relax.TupleGetItem(value, i), "item"), f)
                      for i, f in enumerate(original.fields)]
            return self.emit(relax.Tuple(fields), "tuple")
        if (isinstance(original, relax.TensorType) and _float_dtype(value) is not None
                and _float_dtype(value) != original.dtype):
            return self.cast(value, str(original.dtype))
        return value


_VIEWS = frozenset(f"relax.{n}" for n in ("permute_dims", "reshape", "expand_dims", "squeeze"))


def _without_out_dtype(attrs: tvm.ir.Attrs) -> tvm.ir.Attrs:
    """``attrs`` with ``out_dtype`` unset (the output takes the operands' dtype)."""
    info = type(attrs).__tvm_ffi_type_info__
    fields = {f.name: getattr(attrs, f.name) for f in info.fields}
    fields["out_dtype"] = None
    return tvm.ir.make_node(info.type_key, **fields)


def _operands(args: List[relax.Expr]) -> List[relax.Expr]:
    out: List[relax.Expr] = []
    for a in args:
        out.extend(a.fields if isinstance(a, relax.Tuple) else [a])
    return out


def auto_cast(func: relax.Function, dtype: str, low_output: bool = False) -> relax.Function:
    """``func`` with its compute in ``dtype`` ("bfloat16" or "float16") by the rules above.

    ``low_output`` (a pipeline stage before the last, runtime/pipeline_executor.py): the result (the
    first field when the function returns a tuple) is returned in ``dtype``, so the
    activation sent to the next stage, and the gradient it sends back, are half the bytes.
    The stage's input stays float32: TVM's Gradient differentiates only float32 / float64 /
    float16 inputs, not bfloat16 (runtime/schedule_run.py converts the received message)."""
    if dtype not in LOW_DTYPES:
        raise ValueError(f"auto_cast: dtype must be one of {LOW_DTYPES}, got {dtype!r}")
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        raise NotImplementedError("auto_cast: the function's body is not a sequence of blocks")
    bb = relax.BlockBuilder()
    caster = _Caster(bb, dtype)
    result = body.body.fields[0] if isinstance(body.body, relax.Tuple) else body.body
    if low_output and not isinstance(result, relax.Var):
        raise NotImplementedError(f"auto_cast: low_output needs the function to return a "
                                  f"variable (or a tuple of them), got {body.body}")
    attrs = dict(func.attrs) if func.attrs is not None else {}
    with bb.function("f", list(func.params), attrs=attrs or None, pure=func.is_pure):
        for block in body.blocks:
            dataflow = isinstance(block, relax.DataflowBlock)
            with (bb.dataflow() if dataflow else _nothing()):
                for binding in block.bindings:
                    low = dtype if low_output and binding.var.same_as(result) else None
                    _emit_binding(caster, binding, dataflow, low)
        bb.emit_func_output(caster.remap(body.body))
    out = bb.get()["f"]  # the input's attributes (its global_symbol included), not "f"'s
    return relax.Function(out.params, out.body, out.ret_ty, out.is_pure, func.attrs)


def _lowered(caster: "_Caster", value: relax.Var, dtype: str) -> relax.Expr:
    """``value`` (a float32 tensor, or a tuple whose first field is one) with that tensor
    cast to ``dtype``: a pipeline stage's result, sent in the low dtype."""
    if isinstance(value.ty, relax.TupleType):
        fields = [caster.emit(relax.TupleGetItem(value, i), "item")
                  for i in range(len(value.ty.fields))]
        return caster.emit(relax.Tuple([_lowered(caster, fields[0], dtype), *fields[1:]]),
                           "tuple")
    if _float_dtype(value) != "float32":
        raise ValueError(f"auto_cast: low_output needs a float32 result, got {value.ty}")
    return caster.emit(relax.op.astype(value, dtype), "output_low")


def _emit_binding(caster: _Caster, binding: relax.Binding, dataflow: bool,
                  low_output: Optional[str] = None) -> None:
    """One binding again, by the rules; ``low_output``: it is the function's result, to
    leave in that dtype (``auto_cast``'s low_output)."""
    bb = caster.bb
    if not isinstance(binding, relax.VarBinding):
        raise NotImplementedError(f"auto_cast: {type(binding).__name__} bindings are not "
                                  "supported in a forward")
    value = caster.remap(binding.value)
    if isinstance(value, relax.Call):
        value = caster.call(value)
    name = binding.var.name
    if not dataflow or isinstance(binding.var, relax.DataflowVar):
        var = caster.emit(value, name)
        if low_output is not None:  # a result bound outside a dataflow block
            var = _lowered(caster, caster.restore(var, binding.var.ty), low_output)
        caster.values[binding.var] = var
        return
    # a dataflow block's output leaves the block: its original dtype back
    new = caster.restore(caster.emit(value, f"{name}_cast"), binding.var.ty)
    if low_output is not None:
        new = _lowered(caster, new, low_output)
    caster.values[binding.var] = bb.emit_output(new, name_hint=name)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---- after autodiff: sums of products in float32 --------------------------------------------
_PRODUCTS = frozenset(f"relax.{n}" for n in (
    "matmul", "einsum", "nn.conv1d", "nn.conv2d", "nn.conv3d", "nn.conv1d_transpose",
    "nn.conv2d_transpose", "nn.conv3d_transpose"))


#: reductions: a 16-bit one (the backward's bias gradients: ``collapse_sum_to`` of a 16-bit
#: output gradient) is computed on its input widened to float32
_REDUCTIONS = frozenset(f"relax.{n}" for n in (
    "sum", "mean", "variance", "std", "prod", "cumsum", "cumprod", "collapse_sum_to",
    "collapse_sum_like"))


@mutator
class _Accumulate(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if (isinstance(call.op, tvm.ir.Op) and call.op.name in _REDUCTIONS
                and _float_dtype(call) in LOW_DTYPES):
            wide = self.builder_.emit(relax.op.astype(call.args[0], "float32"))
            reduced = self.builder_.emit(relax.Call(call.op, [wide, *call.args[1:]],
                                                    call.attrs, call.ty_args))
            return relax.op.astype(reduced, str(call.ty.dtype))
        if (not isinstance(call.op, tvm.ir.Op) or call.op.name not in _PRODUCTS
                or _float_dtype(call) not in LOW_DTYPES or call.attrs is None
                or not hasattr(call.attrs, "out_dtype") or call.attrs.out_dtype is not None):
            return call
        info = type(call.attrs).__tvm_ffi_type_info__
        fields = {f.name: getattr(call.attrs, f.name) for f in info.fields}
        fields["out_dtype"] = "float32"
        wide = relax.Call(call.op, call.args, tvm.ir.make_node(info.type_key, **fields),
                          call.ty_args)
        return relax.op.astype(self.builder_.emit(wide), str(call.ty.dtype))


@tvm.transform.module_pass(opt_level=0, name="AccumulateInFloat32")
class AccumulateInFloat32:
    """A 16-bit matmul / convolution that DispatchToBLAS left to TVM accumulates in float32
    (``out_dtype="float32"``, then one cast down), and a 16-bit reduction (the backward's
    ``collapse_sum_to`` of bias gradients, any sum or mean) reduces its input widened to
    float32: TVM's kernels otherwise round a running sum to 16 bits at every step into a
    16-bit output buffer (a 4096-long bfloat16 sum of ones gives 256)."""

    def transform_module(self, mod, ctx):
        return mutate_functions(mod, _Accumulate(mod))
