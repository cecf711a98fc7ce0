"""``Trainer.metrics()``: what the last step did, in the units training logs use (loss, lr,
rows and tokens per second, achieved FLOP/s and MFU, step time).

FLOPs are counted from the IR each rank runs (its step, or its pipeline stages' forward and
backward): 2·M·N·K per matmul, 2·(output elements)·(input channels / groups)·(kernel
elements) per convolution; the elementwise work, a few percent of a transformer's, is left
out as Megatron's and PaLM's MFU formulas do. The peak is the machine's, not a datasheet's:
a float32 GEMM measured once through the BLAS the steps call (numpy's), with the threads
this process uses, once per process (a measured peak says what this process could reach;
MFU against it is the share of the GEMM rate the whole step achieves).
"""
import logging
import os
import platform
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import tvm
from tvm import relax

from .. import device as device_lib
from ..ir.ops import ATTENTION, ATTENTION_GRAD
from ..ir.attention import flops as attention_flops
from ..ir.context_parallel import CP_ATTENTION, CP_ATTENTION_GRAD
from ..ir.context_parallel import flops as cp_attention_flops

_LOG = logging.getLogger("raf_dist")
_GEMM_N = 1024
_peaks: Dict[str, float] = {}


def function_flops(func: relax.Function) -> int:
    """Multiply-add FLOPs (x2) of the matmuls and convolutions in ``func``."""
    total = 0

    def visit(expr: relax.Expr) -> None:
        nonlocal total
        total += call_flops(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return total


def call_flops(expr: relax.Expr) -> int:
    """Multiply-add FLOPs (x2) of one matmul, convolution or attention call, else 0."""
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)):
        return 0
    name = expr.op.name
    if name == "relax.matmul":
        return _matmul_flops(expr)
    if name in (ATTENTION, ATTENTION_GRAD):
        return attention_flops(expr)
    if name in (CP_ATTENTION, CP_ATTENTION_GRAD):
        return cp_attention_flops(expr)
    if name.startswith("relax.nn.conv"):
        return _conv_flops(expr, transpose=name.endswith("_transpose"))
    return 0


def static_shape(expr: relax.Expr) -> Optional[List[int]]:
    """The static shape of ``expr``'s type; None when it has none or a symbolic dimension."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None:
        return None
    try:
        return [int(d) for d in getattr(shape, "values", shape)]
    except (TypeError, ValueError):  # a symbolic dimension
        return None


def _matmul_flops(call: relax.Call) -> int:
    lhs, out = static_shape(call.args[0]), static_shape(call)
    if lhs is None or out is None or not lhs:
        return 0
    return 2 * int(np.prod(out, dtype=np.int64)) * lhs[-1]


def _conv_flops(call: relax.Call, transpose: bool) -> int:
    """Whatever the layouts (autodiff's weight gradient is a convolution in CNHW / IOHW):
    a convolution does (output elements) x (kernel's I extent) x (kernel window) MACs, a
    transposed one (input elements) x (kernel's O extent) x (kernel window); the kernel's I
    (O) extent is already the channels of one group."""
    data, weight, out = (static_shape(call.args[0]), static_shape(call.args[1]),
                         static_shape(call))
    if data is None or weight is None or out is None:
        return 0
    layout = str(call.attrs.kernel_layout)
    window = int(np.prod([d for axis, d in zip(layout, weight) if axis not in "IO"],
                         dtype=np.int64))
    if transpose:
        return 2 * int(np.prod(data, dtype=np.int64)) * weight[layout.index("O")] * window
    return 2 * int(np.prod(out, dtype=np.int64)) * weight[layout.index("I")] * window


def module_flops(functions: Iterable[relax.Function]) -> int:
    return sum(function_flops(f) for f in functions)


def peak_flops(threads: int) -> float:
    """This machine's float32 GEMM rate (FLOP/s) with ``threads`` BLAS threads, measured
    once per process (best of 5 at n = 1024, ~0.2 s) and kept. Not cached across processes:
    a peak measured while something else ran would make every later MFU too high."""
    key = f"{_cpu_model()}|threads={threads}|float32"
    if key in _peaks:
        return _peaks[key]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((_GEMM_N, _GEMM_N), dtype=np.float32)
    b = rng.standard_normal((_GEMM_N, _GEMM_N), dtype=np.float32)
    np.matmul(a, b)  # warm-up: threads started, pages touched
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    _peaks[key] = 2.0 * _GEMM_N ** 3 / best
    return _peaks[key]


def _cpu_model() -> str:
    return device_lib.cpu_info("model name") or platform.processor() or platform.machine()


class StepMetrics:
    """The last step's measurements, kept by an executor (``record`` after each step)."""

    def __init__(self, tokens_per_row: int, log_every: int = 0) -> None:
        self.tokens_per_row, self.log_every = int(tokens_per_row), int(log_every)
        self.last: Dict[str, Any] = {}

    def record(self, step: int, loss: float, lr: float, seconds: float, flops: float,
               global_rows: int, grad_norm: Optional[float] = None,
               loss_scale: Optional[float] = None) -> None:
        """``flops``: this rank's FLOPs in the step; ``global_rows``: the whole job's rows."""
        achieved = flops / seconds if seconds > 0 else 0.0
        self.last = {
            "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "step_time_s": seconds,
            "rows_per_s": global_rows / seconds if seconds > 0 else 0.0,
            "tokens_per_s": (global_rows * self.tokens_per_row / seconds
                             if self.tokens_per_row and seconds > 0 else None),
            "flops_per_step": flops, "flops_per_s": achieved,
            "mfu": achieved / peak_flops(_threads()) if flops else None,
            "loss_scale": loss_scale}
        if self.log_every and step % self.log_every == 0:
            _LOG.info("step %d: %s", step, ", ".join(
                f"{k} {_fmt(v)}" for k, v in self.last.items() if k != "step" and v is not None))


def _threads() -> int:
    """The compute threads of this process (runtime/threads.py sets TVM_NUM_THREADS, and
    limits the BLAS numpy calls to as many)."""
    try:
        return int(os.environ.get("TVM_NUM_THREADS", "0")) or len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        return os.cpu_count() or 1


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def tokens_per_row(input_specs: Sequence[Tuple[Sequence[int], str]]) -> int:
    """Tokens a row of the batch carries: the sequence length when the first input is a
    (rows, seq) tensor of integer ids (a language model), else 0 (rows are the unit)."""
    if not input_specs:
        return 0
    shape, dtype = input_specs[0]
    return int(shape[1]) if len(shape) == 2 and str(dtype).startswith("int") else 0
