"""Where a training step's time goes: a Chrome trace (Trace Event Format) per rank.

``Trainer.profile(steps, path)`` (or ``RAF_DIST_PROFILE=dir``) records the next steps and
writes ``path/trace-rank{R}.json``, which opens in Perfetto (ui.perfetto.dev) or
chrome://tracing; ``python -m raf_dist.tools.timeline DIR -o timeline.png`` merges the ranks.

How: TVM's VM calls an instrument function before and after every call instruction it
executes (``VirtualMachine.set_instrument``), with the callee's name and arguments. (TVM
0.27 has no VM profiler any more: ``VirtualMachine`` takes no ``profile=`` and its runtime
library registers no profiler VM.) Each call becomes one complete ("X") event, categorised by
the callee:

  kernel      a PrimFunc TVM generated (fused elementwise, reductions, the optimizer)
  blas        raf_dist.blas.* (numpy / CuPy matmul and convolution); args: operand shapes
              (a matmul's transpose flags too)
  collective  raf_dist.ccl.* — a blocking collective, the *start* of an asynchronous one and
              its *wait*; args: bytes of the full (unsharded) buffer, element count, dtype
  vm          the VM's own builtins (allocation, shape checks, tuples)

plus one "step" event per Trainer.step. Asynchronous collectives run on the native runtime's
communication thread (src/ccl/), which this profiler does not see: a start event is the time
to enqueue, and a wait event the time the step was blocked on the transfer; the transfer
itself overlaps whatever lies between the two.

Timestamps are wall-clock microseconds (time.time_ns at the profiler's start plus the
monotonic clock since), so traces of ranks on different hosts line up as well as their clocks.
The instrument is a Python callback, so every call pays its cost while profiling (measured on
the GPT step of bench/step_time.py: see README "Profiling"); nothing is paid otherwise.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence, TypeVar

import numpy as np
import tvm

if TYPE_CHECKING:
    from tvm.runtime.vm import VirtualMachine

logger = logging.getLogger("raf_dist")

_NO_OP = 0  # tvm.runtime.vm.VMInstrumentReturnKind.NO_OP: run the call as usual

_Result = TypeVar("_Result")


_COLLECTIVES = {"allreduce", "reduce_scatter", "allgather", "broadcast", "send", "recv", "wait"}


def category(symbol: str) -> str:
    """The trace category of a VM callee (see the module docstring); raf_dist's other native
    helpers (bucket packing, local_shard) are copies and count as kernels."""
    if symbol.startswith("raf_dist.ccl."):
        op = symbol[len("raf_dist.ccl."):]
        return "collective" if op.removesuffix("_start") in _COLLECTIVES else "kernel"
    if symbol.startswith("raf_dist.blas."):
        return "blas"
    if symbol.startswith("vm."):
        return "vm"
    return "kernel"


def _tensor_args(args: Iterable[Any]) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every tensor among a call's arguments."""
    out = []
    for arg in args:
        shape = getattr(arg, "shape", None)
        dtype = getattr(arg, "dtype", None)
        if shape is not None and dtype is not None:
            out.append((tuple(int(d) for d in shape), str(dtype)))
    return out


def _call_args(symbol: str, kind: str, args: Iterable[Any]) -> dict[str, Any]:
    """What a trace event's ``args`` say about a BLAS call or a collective."""
    args = list(args)
    tensors = _tensor_args(args)
    if kind == "blas":
        out: dict[str, Any] = {"shapes": [list(shape) for shape, _ in tensors]}
        if symbol.endswith(".matmul"):  # (a, b, trans_a, trans_b, out): the flags too
            out["trans"] = [int(a) for a in args
                            if isinstance(a, (bool, int, np.integer))][:2]
        return out
    if kind == "collective" and tensors:
        # the largest buffer is the full one: the input of allreduce / reduce_scatter, the
        # output of allgather, the bucket a wait completes
        shape, dtype = max(tensors, key=lambda t: int(np.prod(t[0], dtype=np.int64)))
        numel = int(np.prod(shape, dtype=np.int64))
        return {"bytes": numel * tvm.DataType(dtype).bits // 8, "numel": numel, "dtype": dtype,
                "op": symbol.rsplit(".", 1)[-1]}
    return {}


class TraceRecorder:
    """Events of one rank, as the Trace Event Format's complete events. The instrument keeps
    raw tuples and the events are built by ``trace()``: the less it does per call, the less
    it inflates what it measures."""

    def __init__(self, rank: int, tid: int = 0) -> None:
        self.rank = int(rank)
        self.tid = tid
        # (symbol, start ns, end ns, args or None), in completion order
        self._calls: list[tuple[str, int, int, dict[str, Any] | None]] = []
        # (name, category, start ns, end ns, args)
        self._extra: list[tuple[str, str, int, int, dict[str, Any]]] = []
        self._open: list[int] = []  # start ns of the calls not yet returned (nesting-safe)
        self._kinds: dict[str, str] = {}  # symbol -> category, computed once per symbol
        self._wall_offset_ns = time.time_ns() - time.perf_counter_ns()

    def instrument(self, func: Any, symbol: str, before_run: bool, ret_value: Any,
                   *args: Any) -> int:
        """The VM instrument: called before and after every call instruction."""
        now = time.perf_counter_ns()
        if before_run:
            self._open.append(now)
            return _NO_OP
        kind = self._kinds.get(symbol)
        if kind is None:
            kind = self._kinds[symbol] = category(str(symbol))
        details = _call_args(symbol, kind, args) if kind in ("blas", "collective") else None
        self._calls.append((symbol, self._open.pop(), now, details))
        return _NO_OP

    def add(self, name: str, kind: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """One complete event from perf_counter_ns timestamps."""
        self._extra.append((name, kind, start_ns, end_ns, args))

    def __len__(self) -> int:
        return len(self._calls) + len(self._extra)

    def _event(self, name: str, kind: str, start_ns: int, end_ns: int,
               args: dict[str, Any] | None) -> dict[str, Any]:
        event: dict[str, Any] = {"name": str(name), "cat": kind, "ph": "X",
                                 # wall-clock microseconds
                                 "ts": (start_ns + self._wall_offset_ns) / 1000.0,
                                 "dur": (end_ns - start_ns) / 1000.0, "pid": self.rank,
                                 "tid": self.tid}
        if args:
            event["args"] = args
        return event

    def trace(self) -> dict[str, Any]:
        """The Trace Event Format document (rank and thread named for the viewers)."""
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": self.tid,
                 "args": {"name": f"rank {self.rank}"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": self.tid,
                 "args": {"name": "step (TVM VM)"}}]
        events = [self._event(n, self._kinds[n], b, e, a) for n, b, e, a in self._calls]
        events += [self._event(*extra) for extra in self._extra]
        events.sort(key=lambda event: event["ts"])
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def trace_path(directory: str | os.PathLike[str], rank: int) -> Path:
    return Path(directory) / f"trace-rank{int(rank)}.json"


class StepProfiler:
    """Records ``steps`` consecutive Trainer steps on the VMs ``vms`` (one VirtualMachine or
    several: a step compiled per batch size, a pipeline's stages and update) and writes the
    trace when the last one ends (or when the process exits first). A VM built while it
    records (a new batch size) joins through ``attach``."""

    def __init__(self, vms: VirtualMachine | Sequence[VirtualMachine], rank: int, steps: int,
                 directory: str | os.PathLike[str]) -> None:
        if int(steps) < 1:
            raise ValueError(f"profile(steps={steps!r}): give the number of steps to record (>= 1)")
        self.vms: list[VirtualMachine] = []
        self.remaining = int(steps)
        self.path = trace_path(directory, rank)
        self.recorder = TraceRecorder(rank)
        self.written = False
        for vm in (vms if isinstance(vms, (list, tuple)) else [vms]):
            self.attach(vm)
        atexit.register(self.finish)
        logger.info("profiling the next %d step(s) of rank %d into %s", self.remaining, rank,
                    self.path)

    @property
    def active(self) -> bool:
        return self.remaining > 0

    def attach(self, vm: VirtualMachine) -> None:
        """Record ``vm``'s calls too, while steps remain to be recorded."""
        if self.active and not any(v is vm for v in self.vms):
            vm.set_instrument(self.recorder.instrument)
            self.vms.append(vm)

    def step(self, run_step: Callable[..., _Result], step_number: int, *args: Any) -> _Result:
        """``run_step(*args)`` recorded as one "step" event (with the VM calls inside it)."""
        start = time.perf_counter_ns()
        try:
            return run_step(*args)
        finally:
            self.recorder.add(f"step {step_number}", "step", start, time.perf_counter_ns(),
                              step=step_number)
            self.remaining -= 1
            if self.remaining == 0:
                self.finish()

    def finish(self) -> None:
        """Stop recording and write the trace (once)."""
        if self.written:
            return
        self.written = True
        self.remaining = 0
        for vm in self.vms:
            vm.set_instrument(None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.recorder.trace()))
        os.replace(tmp, self.path)  # a reader never sees half a trace
        atexit.unregister(self.finish)
        logger.info("wrote %d trace events to %s", len(self.recorder), self.path)
