"""The step's host kernels that run outside TVM's memory planner (``raf_dist.blas.*``: numpy's
OpenBLAS, PyTorch's oneDNN for 16-bit GEMMs; ``raf_dist.attention.*``: PyTorch's flash
attention, runtime/attention_kernels.py), listed from a planned step and run once at the
step's shapes, so that what they take for themselves can be measured before any step runs.

What these libraries hold after a step is their own policy, not the step's: OpenBLAS touches
a part of each thread's packing buffer (a 32 / 64 MiB mapping it keeps for the process) that
depends on the GEMM shapes and its blocking for the CPU; the convolutions' im2col, padding and
col2im copies are numpy temporaries that glibc, under its dynamic mmap threshold, keeps as free
heap between steps (ResNet-10 at batch 64: 16 MiB); TVM's pool, whose workers run the GEMMs'
jobs, starts its threads on the first parallel call. Modelling each from its library's
internals per CPU would be a copy of those internals that goes stale with them, so
``tools/estimate_memory`` measures them instead (``measure``), the way
``process_memory.first_run`` measures a run's first step, in a child process of its own (the
thread pool a rank of the run would have is made there, and nothing of it stays in the
caller): each call once on operands of the step's shapes and dtypes, which live in private
anonymous mappings of their own (never in the C heap, so they leave the allocator's state as
they found it, and their pages go back whole when unmapped). The operands are zero pages,
read without being copied: the kernels' memory does not depend on the values.

    python -m raf_dist.runtime.host_kernels < calls.json   (what ``measure`` runs)
"""
from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterator, List, Sequence, Tuple

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..compiler.memory import nbytes

logger = logging.getLogger("raf_dist")

#: the packed functions of runtime/blas.py and runtime/attention_kernels.py (registered when
#: raf_dist.runtime is imported)
PREFIXES = ("raf_dist.blas.", "raf_dist.attention.")


@dataclass(frozen=True)
class HostCall:
    """One call of a host kernel: its packed function and its arguments, tensors as
    ``("tensor", shape, dtype)``, shapes as tuples, the rest as they are (ints, strings)."""

    symbol: str
    args: Tuple[Any, ...]

    def tensor_bytes(self) -> int:
        return sum(_nbytes(a[1], a[2]) for a in self.args if _is_tensor(a))


def _is_tensor(arg: Any) -> bool:
    return isinstance(arg, tuple) and len(arg) == 3 and arg[0] == "tensor"


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    return nbytes(int(np.prod(shape, dtype=np.int64)), dtype)


def _argument(arg: relax.Expr) -> Any:
    """The static description of one argument; None when it is not static."""
    if isinstance(arg, relax.ShapeExpr):
        values = [v.value if isinstance(v, tvm.tirx.IntImm) else None for v in arg.values]
        return None if None in values else tuple(int(v) for v in values)
    if isinstance(arg, tvm.tirx.IntImm):  # relax.prim_value(int)
        return int(arg.value)
    if isinstance(arg, tvm.tirx.FloatImm):  # relax.prim_value(float): attention's scale
        return float(arg.value)
    if isinstance(arg, tvm.ir.StringImm):
        return str(arg.value)
    ty = getattr(arg, "ty", None)
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        shape = _argument(ty.shape)
        return None if shape is None else ("tensor", shape, str(ty.dtype))
    return None


def host_calls(mod: tvm.IRModule) -> List[HostCall]:
    """The distinct host-kernel calls of ``mod`` (a step after memory planning, where they are
    ``R.call_packed("raf_dist.blas.*", ..., out)`` and the attention kernels), in order of first appearance. Calls
    whose shapes are not static are left out (and logged)."""
    seen: dict = {}

    def visit(expr: relax.Expr) -> None:
        if not (isinstance(expr, relax.Call) and isinstance(expr.op, relax.ExternFunc)):
            return
        symbol = str(expr.op.global_symbol)
        if not symbol.startswith(PREFIXES):
            return
        args = tuple(_argument(a) for a in expr.args)
        if any(a is None for a in args):
            logger.debug("host kernel %s with dynamic arguments not measured", symbol)
            return
        seen.setdefault((symbol, args), HostCall(symbol, args))

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return list(seen.values())


@contextlib.contextmanager
def _zero_tensor(shape: Sequence[int], dtype: str) -> Iterator[Any]:
    """A TVM tensor of ``shape`` and ``dtype`` on a private anonymous mapping of its own
    (zero pages until written), unmapped on exit."""
    size = max(1, _nbytes(shape, dtype))
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = tensor = None
    try:
        bits = tvm.DataType(dtype).bits
        # the bytes as an unsigned integer array (numpy exports no bfloat16), retyped in TVM
        raw = np.frombuffer(buf, dtype=f"uint{bits}", count=size * 8 // bits)
        tensor = tvm_ffi.from_dlpack(raw.reshape(tuple(shape)))
        if str(tensor.dtype) != dtype:
            tensor = tensor._create_view(tuple(shape), dtype)
        yield tensor
    finally:
        raw = tensor = None
        try:
            buf.close()
        except BufferError:  # a view outlived the call (a kernel kept it): the GC unmaps it
            logger.debug("an operand of a host kernel is still referenced")


def run_once(calls: Sequence[HostCall]) -> None:
    """Each call once, through its registered packed function, on zero operands (module
    docstring); the operands' pages are unmapped after each call."""
    from . import attention_kernels, blas  # noqa: F401  (registers the host kernels)

    for call in calls:
        func = tvm_ffi.get_global_func(call.symbol)
        with contextlib.ExitStack() as stack:
            args = [stack.enter_context(_zero_tensor(a[1], a[2])) if _is_tensor(a)
                    else tvm_ffi.Shape(a) if isinstance(a, tuple) else a for a in call.args]
            func(*args)
            del args


def _from_json(arg: Any) -> Any:
    return tuple(_from_json(a) for a in arg) if isinstance(arg, list) else arg


def measure(calls: Sequence[HostCall], threads: int, timeout_s: float = 600.0) -> dict:
    """What ``calls`` keep and leave, measured in a child process with ``threads`` compute
    threads (``runtime.threads.set_num_threads``, as a Trainer sets them): ``runtime_bytes``,
    their first run's anonymous growth beyond the allocator's free bytes (what
    ``process_memory.first_run`` records for a step), then, after the heap is given back as
    after a run's first step, ``allocator_free_bytes`` a second run leaves free. Both 0 when
    there are no calls or the child fails (logged: an estimate, never an error)."""
    if not calls:
        return {"runtime_bytes": 0, "allocator_free_bytes": 0}
    # JSON writes the arguments' tuples as lists; the child turns them back (_from_json)
    payload = json.dumps({"threads": int(threads), "calls": [[c.symbol, c.args] for c in calls]})
    try:
        done = subprocess.run([sys.executable, "-m", "raf_dist.runtime.host_kernels"],
                              input=payload, capture_output=True, text=True,
                              timeout=timeout_s, env=dict(os.environ), check=False)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:])
        return {k: int(v) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    except (OSError, RuntimeError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
        logger.warning("the step's host kernels were not measured (their memory is left out "
                       "of the estimate): %s", e)
        return {"runtime_bytes": 0, "allocator_free_bytes": 0}


def _main() -> None:
    from .. import process_memory
    from .threads import set_num_threads

    request = json.loads(sys.stdin.read())
    calls = [HostCall(symbol, _from_json(args)) for symbol, args in request["calls"]]
    set_num_threads(request["threads"])
    runtime = process_memory.runtime_growth_of(lambda: run_once(calls))
    run_once(calls)  # what a later step leaves in the allocator's free heap
    print(json.dumps({"runtime_bytes": runtime,
                      "allocator_free_bytes": process_memory.allocator_free_bytes()}))


if __name__ == "__main__":
    _main()
