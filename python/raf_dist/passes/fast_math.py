"""Fast math: the transcendental functions of a training step as arithmetic LLVM vectorises,
where the libm calls TVM legalizes them to run one element at a time (after the matmuls,
gelu, its gradient and softmax were the GPT step's largest kernels). Both keep float32
accuracy (tests/passes/test_fast_math.py). On bfloat16 / float16 tensors (mixed precision)
the same functions are computed in float32 between a cast in and a cast out (``_WIDENED``).

FastGelu. Input: a module before LegalizeOps. Output: every ``R.nn.gelu(x)`` becomes
``x * (0.5 + 0.5 * erf(x / sqrt(2)))`` and every ``R.erf`` (the gelu gradient's too) TVM's
``fast_erf``, which agrees with erf to float32 rounding; every ``R.tanh`` (gelu's tanh form
and its gradient) TVM's ``fast_tanh`` (a clamped rational approximation, float32 accuracy);
every ``R.power`` by a constant 2, 3 or 4 (gelu_new's cube, RMSNorm's square) products.

FastExp. Input: a module before LegalizeOps. Output: every ``R.exp`` (the gelu gradient's,
cross-entropy's backward) becomes ``exp_float32`` below, every ``R.sigmoid`` (SiLU's)
``1 / (1 + exp_float32(-x))``, and ``R.nn.softmax`` /
``R.nn.log_softmax`` become the same max / exp / sum / normalise stages as TOPI's with that
exp. Why not TVM's ``fast_exp``: it reduces the argument with a single ln 2 constant, off by
up to 4e-6 relative (measured: -87 < x < -20); Cephes' two-constant reduction keeps 1-2 ulp.
"""
import math

import tvm
from tvm import relax, te, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ir.attrs import MATERIALIZE
from ..ir.utils import mutate_functions
from .auto_cast import LOW_DTYPES

_GELU = tvm.ir.Op.get("relax.nn.gelu")
_ERF = tvm.ir.Op.get("relax.erf")
_TANH = tvm.ir.Op.get("relax.tanh")
_POWER = tvm.ir.Op.get("relax.power")
_SUBTRACT = tvm.ir.Op.get("relax.subtract")
_EXP = tvm.ir.Op.get("relax.exp")
_SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
_LOG_SOFTMAX = tvm.ir.Op.get("relax.nn.log_softmax")
_SIGMOID = tvm.ir.Op.get("relax.sigmoid")


#: 16-bit floats (AutoCast's): their transcendental functions are computed in float32 (a
#: cast in, the float32 rewrite, a cast out; FuseOps puts the three in one kernel, so the
#: tensors read and written stay 16-bit). TVM legalizes a bfloat16 erf / exp / tanh to the
#: float32 libm call one element at a time (BF16ComputeLegalize): measured on a bf16 GPT step
#: (avx512_bf16 + AMX Xeon, bench/mixed_precision.py --model gpt), libm's erff and expf were
#: 30% of the step.
_WIDENED = LOW_DTYPES


def _dtype(expr):
    return expr.ty.dtype


@mutator
class _Rewrite(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op in (_GELU, _ERF, _TANH) and _dtype(call.args[0]) in _WIDENED:
            return _widened(self.builder_, call, self._float32)
        return self._float32(call)

    def _float32(self, call):
        """The float32 rewrite of ``call`` (itself when none applies)."""
        if call.op == _GELU and _dtype(call.args[0]) == "float32":
            x = call.args[0]
            half = relax.const(0.5, "float32")
            scaled = self.builder_.emit(relax.op.multiply(x, relax.const(1 / math.sqrt(2), "float32")))
            erf = self.builder_.call_te(topi.fast_erf, scaled)
            cdf = self.builder_.emit(relax.op.add(half, relax.op.multiply(erf, half)))
            return relax.op.multiply(x, cdf)
        if call.op == _ERF and _dtype(call.args[0]) == "float32":
            return self.builder_.call_te(topi.fast_erf, call.args[0])
        if call.op == _TANH and _dtype(call.args[0]) == "float32":
            # gelu(approximate="tanh") (GPT-2) and its gradient: libm tanh one element at a
            # time was GPT-2's slowest kernel (5 ms a call, bench/models.py)
            return self.builder_.call_te(topi.fast_tanh, call.args[0])
        if call.op == _POWER:
            exponent = _small_integer(self._constant_value(call.args[1]))
            if exponent is not None and _dtype(call.args[0]) in ("float32", "float64") + _WIDENED:
                # x ** 2 (RMSNorm, Llama), x ** 3 (gelu_new, GPT-2): TVM legalizes power to
                # libm's pow, one element at a time (GPT-2's gelu kernel: 2.3 ms a call on
                # 262k elements); products are exact the same way pow is (correctly rounded
                # for 2, within an ulp for 3) and vectorise
                x = call.args[0]
                result = x
                for _ in range(exponent - 1):
                    result = self.builder_.emit(relax.op.multiply(result, x))
                return result
        return call

    def _constant_value(self, expr):
        """A scalar constant's value, also through a variable bound to the difference of two
        constants (power's gradient: ``x ** (p - 1)``); else None."""
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if isinstance(bound, relax.Call) and bound.op == _SUBTRACT:
                a, b = (self._constant_value(arg) for arg in bound.args)
                return None if a is None or b is None else a - b
            return None
        if isinstance(expr, tvm.ir.expr.Constant) and tuple(expr.value.shape) == ():
            return float(expr.value.numpy())
        return None


def _small_integer(value):
    """``value`` as an int when it is 1, 2, 3 or 4, else None (1: the gradient of a square,
    ``2 * x ** (2 - 1)``, which libm's pow computed one element at a time: a Llama's RMSNorm
    backward, 1.3 ms a call on 512 x 768)."""
    return int(value) if value in (1.0, 2.0, 3.0, 4.0) else None


def _widened(builder, call, rewrite):
    """``call`` on a 16-bit tensor computed in float32: its argument cast up, ``rewrite``
    applied to the float32 call, the result cast back to the argument's dtype."""
    low = _dtype(call.args[0])
    wide = builder.emit(relax.op.astype(call.args[0], "float32"))
    result = rewrite(relax.Call(call.op, [wide] + list(call.args[1:]), call.attrs))
    return relax.op.astype(builder.emit(result) if isinstance(result, relax.Call) else result,
                           low)


@tvm.transform.module_pass(opt_level=0, name="FastGelu")
class FastGelu:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        return mutate_functions(mod, _Rewrite(mod))


# Cephes expf: exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 computed with ln 2
# split in two (the high part exact in float32) so r keeps its low bits, then a degree-7
# polynomial for exp(r) on |r| <= ln 2 / 2, and 2^n built in the exponent bits.
# Beyond [_EXP_LO, _EXP_HI]: 0 and inf. Above log(FLT_MAX) float32 overflows anyway; below
# ln(FLT_MIN) the denormals libm would return are flushed to 0 (absolute error < 1.2e-38).
_EXP_HI, _EXP_LO = 88.72283935546875, -87.3365478515625
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)


def exp_float32(value: tvm.tirx.Expr) -> tvm.tirx.Expr:
    """exp of a float32 scalar expression as vectorisable arithmetic; NaN stays NaN.

    Every intermediate is bound once (``tirx.Let``): written as nested expressions, the
    clamped argument appeared ~40 times in the tree (TE does not share subexpressions) and
    the softmax kernel's source ran to 20 kB. With the exp in a vectorised block of its own
    (``softmax_stages``): softmax over 64x64x64 1.07 -> 0.33 ms, log_softmax over 1024x512
    1.95 -> 1.10 ms (PyTorch: 0.12 / 0.18 ms; the row reductions are what is left).
    """
    def const(v, dtype="float32"):
        return tvm.tirx.const(v, dtype)

    def let(name, expr, body):
        var = tvm.tirx.Var(name, expr.ty)
        return tvm.tirx.Let(var, expr, body(var))

    def with_value(x):
        # selects, not min/max: a comparison with NaN is false, so NaN passes through every
        # step (LLVM's minnum/maxnum would replace it by the bound). Below _EXP_LO the result
        # is the 0 of ``finish``'s select and the lane computes exp(0) meanwhile: computed at
        # the bound it ends a hair under FLT_MIN, a denormal, and every multiply producing one
        # takes a microcode assist (a causal softmax's masked half: the attention's softmax
        # over 8x8x128x128 took 4.3 ms with its upper triangle at -inf, 1.1 ms without)
        clamped = tvm.tirx.Select(x > const(_EXP_HI), const(_EXP_HI), x)
        clamped = tvm.tirx.Select(x < const(_EXP_LO), const(0.0), clamped)
        return let("exp_clamped", clamped, lambda c: let(
            "exp_n", te.floor(c * const(1 / math.log(2)) + const(0.5)),
            lambda n: let("exp_r", c - n * const(_LN2_HI) - n * const(_LN2_LO),
                          lambda r: finish(x, n, r))))

    def finish(x, n, r):
        poly = const(_EXP_POLY[0])
        for coefficient in _EXP_POLY[1:]:
            poly = poly * r + const(coefficient)
        exp_r = poly * r * r + r + const(1.0)
        # 2^n as two factors: n reaches 128 near the top of the range, past float32's exponent
        return let("exp_n_int", n.astype("int32"), lambda n_int: let(
            "exp_half", n_int >> const(1, "int32"), lambda half: tvm.tirx.Select(
                x < const(_EXP_LO), const(0.0), tvm.tirx.Select(
                    x > const(_EXP_HI), const(float("inf")),
                    exp_r * _pow2(half) * _pow2(n_int - half)))))

    if isinstance(value, te.TensorSlice):  # x[i] of a TE tensor
        value = value.asobject()
    return let("exp_x", value, with_value)


def _pow2(n):
    """2^n for an int32 expression -126 <= n <= 127, built in the exponent bits."""
    return tvm.tirx.reinterpret("float32", (n + tvm.tirx.const(127, "int32"))
                                << tvm.tirx.const(23, "int32"))


def _exp(x):
    return te.compute(x.shape, lambda *i: exp_float32(x(*i)), name="exp_float32")


def _sigmoid(x):
    """1 / (1 + exp(-x)) with exp_float32: TVM legalises sigmoid to a libm exp per element
    (a Llama's SiLU, 512 x 2048 floats: 1.39 ms a call). exp(-x) overflows to inf for
    x < -88.7 and the quotient is then 0, as the true value rounds."""
    one = tvm.tirx.const(1.0, "float32")
    return te.compute(x.shape, lambda *i: one / (one + exp_float32(-x(*i))), name="sigmoid")


def _sigmoid_fast_exp(x):
    """_sigmoid with TVM's fast_exp (no Let; see _RewriteExp) on a widened 16-bit tensor."""
    one = tvm.tirx.const(1.0, "float32")
    exp = topi.fast_exp(topi.negative(x))
    return te.compute(x.shape, lambda *i: one / (one + exp(*i)), name="sigmoid")


def softmax_stages(x, axis):
    """TOPI's softmax stages (max, shifted exp, sum) with exp_float32."""
    shape = x.shape
    axis = axis % len(shape)
    reduced = tuple(d for i, d in enumerate(shape) if i != axis)
    k1, k2 = te.reduce_axis((0, shape[axis]), "k1"), te.reduce_axis((0, shape[axis]), "k2")

    def full(index, k):
        return index[:axis] + (k,) + index[axis:]

    def row(index):
        return tuple(v for i, v in enumerate(index) if i != axis)

    max_elem = te.compute(reduced, lambda *i: te.max(x[full(i, k1)], axis=k1), name="row_max")
    # materialised (not inlined into the sum and the normalisation, compiler/schedule.py):
    # its own block is vectorised, a reduction's body is not, and it is computed once
    exp = te.compute(shape, lambda *i: exp_float32(x[i] - max_elem[row(i)]), name="shifted_exp",
                     attrs={MATERIALIZE: 1})
    expsum = te.compute(reduced, lambda *i: te.sum(exp[full(i, k2)], axis=k2), name="row_expsum")
    return max_elem, exp, expsum, row


def _softmax(x, axis):
    _, exp, expsum, row = softmax_stages(x, axis)
    return te.compute(x.shape, lambda *i: exp[i] / expsum[row(i)], name="softmax")


def _log_softmax(x, axis):
    max_elem, _, expsum, row = softmax_stages(x, axis)
    return te.compute(x.shape, lambda *i: x[i] - max_elem[row(i)] - te.log(expsum[row(i)]),
                      name="log_softmax")


@mutator
class _RewriteExp(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op not in (_EXP, _SOFTMAX, _LOG_SOFTMAX, _SIGMOID):
            return call
        if call.op in (_EXP, _SIGMOID) and _dtype(call.args[0]) in _WIDENED:
            # TVM's fast_exp: its 4e-6 relative error (see above) is far below a 16-bit
            # float's rounding, and it has no Let: exp_float32's Lets, inlined into a kernel
            # that computes in bfloat16, keep bfloat16 arithmetic in their values, which
            # BF16ComputeLegalize leaves there (LLVM codegen then fails)
            compute = topi.fast_exp if call.op == _EXP else _sigmoid_fast_exp
            return _widened(self.builder_, call,
                            lambda c: self.builder_.call_te(compute, c.args[0]))
        if _dtype(call.args[0]) in _WIDENED:  # softmax's are float32 under auto_cast
            return _widened(self.builder_, call, self._float32)
        return self._float32(call)

    def _float32(self, call):
        if _dtype(call.args[0]) != "float32":
            return call
        if call.op == _EXP:
            return self.builder_.call_te(_exp, call.args[0])
        if call.op == _SIGMOID:
            return self.builder_.call_te(_sigmoid, call.args[0])
        compute = _softmax if call.op == _SOFTMAX else _log_softmax
        return self.builder_.call_te(compute, call.args[0], int(call.attrs.axis))


@tvm.transform.module_pass(opt_level=0, name="FastExp")
class FastExp:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        return mutate_functions(mod, _RewriteExp(mod))
