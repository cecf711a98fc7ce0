"""FastGelu: gelu through TVM's vectorisable polynomial erf.

Input: a module before LegalizeOps. Output: every ``R.nn.gelu(x)`` becomes
``x * (0.5 + 0.5 * erf(x / sqrt(2)))`` and every ``R.erf`` (the gelu gradient's too) TVM's
``fast_erf``: LLVM vectorises it, where the libm ``erff`` it replaces runs one element at a
time (gelu and its gradient were the GPT step's largest TVM kernels). ``fast_erf`` agrees
with erf to float32 rounding (checked in tests/passes/test_fast_math.py).
"""
import math

import tvm
from tvm import relax, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from .mutate import mutate_functions

_GELU = tvm.ir.Op.get("relax.nn.gelu")
_ERF = tvm.ir.Op.get("relax.erf")


@mutator
class _Rewrite(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op == _GELU and call.args[0].ty.dtype == "float32":
            x = call.args[0]
            half = relax.const(0.5, "float32")
            scaled = self.builder_.emit(relax.op.multiply(x, relax.const(1 / math.sqrt(2), "float32")))
            erf = self.builder_.call_te(topi.fast_erf, scaled)
            cdf = self.builder_.emit(relax.op.add(half, relax.op.multiply(erf, half)))
            return relax.op.multiply(x, cdf)
        if call.op == _ERF and call.args[0].ty.dtype == "float32":
            return self.builder_.call_te(topi.fast_erf, call.args[0])
        return call


@tvm.transform.module_pass(opt_level=0, name="FastGelu")
class FastGelu:
    """See the module docstring."""

    def transform_module(self, mod, ctx):
        return mutate_functions(mod, _Rewrite(mod))
