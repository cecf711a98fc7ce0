"""What the process holds that is not a tensor: the resident memory loading the compiler's
libraries added, measured when raf_dist loads them.

``Trainer.stats()`` and ``raf_dist.estimate_memory`` add these to the tensors' bytes so their
total predicts the process's resident set (DESIGN.md section 1, "Memory"). Two loads are
measured, each the first time it happens after ``import raf_dist``:

- ``COMPILER``: importing Apache TVM (its shared libraries and registries; ~240 MiB of RSS
  on this machine) and raf_dist's own compiler modules, which load on first use, with what
  they import that was not loaded yet (PyTorch itself when the script had not imported it),
  seen by a ``sys.meta_path`` hook around those imports;
- ``"torch.export"``: the first ``torch.export.export`` (``from_pytorch``): PyTorch's
  dynamo, FX and sympy machinery (~100 MiB).

A library loaded before ``import raf_dist`` is part of the baseline the user's process
already had; the pages of its files that become resident afterwards (PyTorch's and Python's
own code run by the capture, torch's convolution kernels run by a step) count, under
``PRELOADED``. Two more terms are measured, not modelled:

- ``allocator_free_bytes``: the C allocator's free bytes held (glibc's ``mallinfo2``), grown
  since ``import raf_dist`` or the last ``malloc_trim`` — freed by the compiler's IR and the
  steps' host work and kept by glibc (its heap's equivalent of the reserved-but-unallocated
  bytes of PyTorch's CUDA caching allocator);
- ``runtime_bytes``: what each executor's first step added beyond its planned temporaries
  and those free bytes — the thread pools' stacks and per-thread arenas (TVM's, OpenMP's),
  BLAS's per-thread buffers, oneDNN's scratchpads and primitive caches, MPI's first-collective
  buffers: the memory of running any step, measured once, around the first.

Light on purpose: no TVM import here.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

_LOADED: Dict[str, int] = {}  # name -> anonymous RSS growth in bytes while it first loaded
_FILES: Dict[str, Set[str]] = {}  # name -> the files that load mapped (shared libraries)
_CODE: Set[str] = set()  # paths of the compiled step libraries this process loaded
_RUNTIME: Dict[int, int] = {}  # id(executor) -> its first step's growth beyond its temporaries
_LOG = logging.getLogger("raf_dist")


def rss_bytes() -> int:
    """This process's resident set size (VmRSS; 0 where /proc is absent)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (VmHWM), in bytes."""
    return _status_kib("VmHWM") * 1024


def _status_kib(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _mapped_files() -> Set[str]:
    """The files this process maps (its shared libraries among them)."""
    try:
        return {fields[5] for fields in (line.split(None, 5) for line in
                                         Path("/proc/self/maps").read_text().splitlines())
                if len(fields) == 6 and fields[5].startswith("/")}
    except OSError:
        return set()


def _smaps() -> List[Tuple[str, str, str, Dict[str, int]]]:
    """(address range, permissions, path or "", {field: bytes}) of every mapping of this
    process (/proc/self/smaps; [] where it is absent)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    mappings: List[Tuple[str, str, str, Dict[str, int]]] = []
    for line in lines:
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            path = line.split(None, 5)[5] if len(fields) >= 6 else ""
            mappings.append((fields[0], fields[1], path, {}))
        elif mappings and len(fields) >= 2 and fields[0].endswith(":") and fields[1].isdigit():
            mappings[-1][3][fields[0][:-1]] = int(fields[1]) * 1024
    return mappings


def _file_pages(sizes: Dict[str, int]) -> int:
    """A file mapping's resident pages that are the file's: its copied-on-write (private)
    pages are anonymous memory, counted in RssAnon (and so by the loads' measurements)."""
    return max(0, sizes.get("Rss", 0) - sizes.get("Anonymous", 0))


def _resident_file_bytes(paths: Set[str]) -> int:
    """Resident bytes of the mappings of ``paths`` now (/proc/self/smaps), their private
    pages aside."""
    if not paths:
        return 0
    return sum(_file_pages(sizes) for _, _, path, sizes in _smaps() if path in paths)


def _start() -> Tuple[int, Set[str]]:
    return _status_kib("RssAnon"), _mapped_files()


def _finish(name: str, start: Tuple[int, Set[str]], add: bool) -> None:
    anon, files = _status_kib("RssAnon"), _mapped_files()
    with _LOCK:
        grown = max(0, anon - start[0]) * 1024
        _LOADED[name] = _LOADED.get(name, 0) + grown if add else _LOADED.get(name, grown)
        _FILES.setdefault(name, set()).update(files - start[1])


def _file_rss() -> Dict[str, int]:
    """{shared library: its mappings' resident file pages} now: the files with an executable
    mapping (a memory-mapped dataset or checkpoint is the user's data, not a library)."""
    maps = _smaps()
    code = {path for _, perms, path, _ in maps if path.startswith("/") and "x" in perms}
    out: Dict[str, int] = {}
    for _, _, path, sizes in maps:
        if path in code:
            out[path] = out.get(path, 0) + _file_pages(sizes)
    return out


#: library_bytes()'s key for the files mapped before ``import raf_dist`` (PyTorch's, numpy's,
#: libpython): their pages that became resident since
PRELOADED = "loaded before raf_dist (pages run since)"


def library_bytes() -> Dict[str, int]:
    """{library: bytes} for the loads measured so far: the anonymous memory each load added
    (registries, Python modules, heap) plus the resident pages, now, of the shared libraries
    it mapped (code pages become resident as they first run, so this is read each time);
    and under ``PRELOADED`` the growth of the resident pages of the files already mapped at
    ``import raf_dist``."""
    with _LOCK:
        names = list(_LOADED)
    now = _file_rss()
    out = {name: _LOADED[name] + sum(now.get(path, 0) for path in _FILES.get(name, set()))
           for name in names}
    grown = sum(max(0, now.get(path, 0) - before) for path, before in _BASE_FILES.items())
    if grown:
        out[PRELOADED] = grown
    return out


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (<malloc.h>, glibc >= 2.33)."""
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2() -> Any:
    try:
        call = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError, TypeError):  # not glibc, glibc < 2.33, not POSIX
        return None
    call.restype = _MallInfo2
    return call


_MALLINFO2 = _mallinfo2()


def _allocator_free() -> int:
    """The C allocator's free bytes held in its arenas (glibc; 0 elsewhere)."""
    return int(_MALLINFO2().fordblks) if _MALLINFO2 is not None else 0


def allocator_free_bytes() -> int:
    """The C allocator's free bytes held, grown since ``import raf_dist`` or since the last
    ``return_free_heap`` (malloc_trim gives the whole free pages back, so what was free
    then is mostly not resident; free chunks smaller than a page and the arenas' untouched
    tops are counted though not resident: an over-estimate of a few MiB at most here)."""
    return max(0, _allocator_free() - _FREE_FLOOR[0])


@contextlib.contextmanager
def first_run(owner: Any, temporaries: Callable[[], int]) -> Iterator[None]:
    """Measure the block (``owner``'s first step) once: its anonymous RSS growth less
    ``temporaries()`` (the host bytes of the planned temporaries it allocated), less the
    allocator's free bytes it left (``allocator_free_bytes`` counts those) and less what
    measured library loads inside it added (``library_bytes`` counts those); then gives the
    heap the block freed back (``return_free_heap``). A step that raises records nothing
    (the next one is measured); the entry goes with ``owner``."""
    key = id(owner)
    if key in _RUNTIME:
        yield
        return
    start = _runtime_start()
    yield
    try:
        grown = _runtime_growth(start) - int(temporaries())
    except Exception as e:  # noqa: BLE001 - a figure for stats(), never the step's failure
        _LOG.debug("the first step's runtime memory was not measured: %s", e)
        return
    with _LOCK:
        _RUNTIME[key] = max(0, grown)
    weakref.finalize(owner, _RUNTIME.pop, key, None)
    # the first step's one-time host work (the VM's and the runtimes' first-call set-up)
    # frees what glibc, under its dynamic mmap threshold, keeps in the heap for the process's
    # lifetime: 16-19 MiB on GPT-2 here, given back now, once (a few ms). What the later steps
    # keep free (the same transient in each: ResNet's convolution buffers) comes back and is
    # counted by allocator_free_bytes
    return_free_heap()


def _runtime_start() -> Tuple[int, int, int]:
    return _status_kib("RssAnon") * 1024, _allocator_free(), _loaded_total()


def _runtime_growth(start: Tuple[int, int, int]) -> int:
    """Anonymous RSS growth since ``start`` (``_runtime_start``) less the allocator's free
    bytes and the measured library loads it includes."""
    anon, free, loaded = start
    return (_status_kib("RssAnon") * 1024 - anon - max(0, _allocator_free() - free)
            - (_loaded_total() - loaded))


def runtime_growth_of(block: Callable[[], Any]) -> int:
    """What ``first_run`` would record for ``block`` (with no planned temporaries), without
    recording it for any owner; then the heap ``block`` freed is given back, as after a
    run's first step. tools/estimate_memory measures the step's host kernels with it
    (runtime/host_kernels.py)."""
    start = _runtime_start()
    block()
    grown = max(0, _runtime_growth(start))
    return_free_heap()
    return grown


def _loaded_total() -> int:
    with _LOCK:
        return sum(_LOADED.values())


def runtime_bytes() -> int:
    """The executors' first steps' growth beyond their planned temporaries (``first_run``)."""
    with _LOCK:
        return sum(_RUNTIME.values())


@contextlib.contextmanager
def measuring(name: str) -> Iterator[None]:
    """Record the RSS growth of the block under ``name`` (only its first time, and only
    when no other measurement encloses it: the watched imports inside count here)."""
    if name in _LOADED or _STATE.depth:
        yield
        return
    start = _start()
    _STATE.depth += 1
    try:
        yield
    finally:
        _STATE.depth -= 1
        _finish(name, start, add=False)


class _Depth(threading.local):
    depth = 0  # measurements open on this thread (the outermost one records)


_STATE = _Depth()
_LOCK = threading.Lock()


class _MeasureImports(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for TVM and raf_dist's own compiler modules it asks the other
    finders for the spec and wraps the loader, so that executing the module is measured
    (the outermost such import only: what it imports in turn is inside its figure)."""

    @staticmethod
    def _watched(fullname: str) -> Optional[str]:
        """The library_bytes() key ``fullname``'s import counts under (None: not watched)."""
        if fullname == "tvm" or fullname.startswith("raf_dist."):
            return COMPILER
        if fullname in ("mpi4py", "mpi4py.MPI"):  # mpi4py.MPI initialises MPI on import
            return MPI
        return None

    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        # (a find_spec alone, as packages probing what is installed do, measures nothing)
        key = self._watched(fullname)
        if key is None or fullname in sys.modules:
            return None
        spec = None
        for finder in sys.meta_path:  # the finders after this one find the real spec
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader: Any = spec.loader
        found: importlib.machinery.ModuleSpec = spec
        counted: str = key

        class _Measured(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
                return _measured(counted, loader.create_module, spec)  # an extension's init

            def exec_module(self, module: Any) -> None:
                module.__loader__ = found.loader = loader  # the real one from now on
                _measured(counted, loader.exec_module, module)

            def __getattr__(self, attr: str) -> Any:  # get_code (runpy, python -m), ...
                return getattr(loader, attr)

        spec.loader = _Measured()
        return spec


#: library_bytes()'s key for TVM with raf_dist's compiler modules (imported on first use)
COMPILER = "tvm, raf_dist's compiler and what they import"
MPI = "mpi"  # mpi4py and the MPI library it initialises


def _measured(key: str, call: Any, arg: Any) -> Any:
    """``call(arg)``, its RSS growth added to ``key`` when no measurement on this thread
    encloses it (the RSS is the process's: another thread allocating meanwhile counts too)."""
    outermost = _STATE.depth == 0
    start = _start() if outermost else None
    _STATE.depth += 1
    try:
        return call(arg)
    finally:
        _STATE.depth -= 1
        if start is not None:
            _finish(key, start, add=True)


def watch_imports() -> None:
    """Measure the imports of TVM and raf_dist's compiler modules from now on (called at the
    end of ``import raf_dist``: what that import loaded is the baseline)."""
    if not any(isinstance(f, _MeasureImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _MeasureImports())


def return_free_heap() -> None:
    """Give the allocator's free heap back to the system (glibc ``malloc_trim``; elsewhere
    nothing): compiling a step frees many small IR objects whose pages glibc otherwise keeps
    for the process's lifetime."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return
    _FREE_FLOOR[0] = _allocator_free()


def after_compile() -> int:
    """What compiling left behind in this process, let go: the heap it freed
    (``return_free_heap``) and the compiler's resident code (``release_compiler_pages``).
    The executors call it between compiling the step and allocating the parameters and the
    optimizer's states (the capture, autodiff and the step's passes run here even when the
    build runs in a forked process: compiler/build.py), so that the transient and the states
    are not resident at once; the Trainer again at the end of construction. Returns the
    compiler bytes dropped."""
    return_free_heap()
    return release_compiler_pages()


#: TVM's compiler (with LLVM): needed to compile a step, never to run one (the step's code and
#: libtvm_runtime.so run it)
COMPILER_LIBRARIES = ("libtvm_compiler.so",)
_MADV_DONTNEED = 4  # <sys/mman.h>


def release_compiler_pages() -> int:
    """Drop this process's resident pages of the compiler's shared libraries
    (``COMPILER_LIBRARIES``): after a step is compiled the process runs it without them, yet
    the 80-90 MiB of code and read-only data the compile touched stay in its RSS for its
    whole life. ``madvise(MADV_DONTNEED)`` on a read-only mapping none of whose pages is
    private (no copied-on-write page, resident or swapped out: a relocated table would
    come back from the file unrelocated) loses nothing: the mapping stays, and a later
    compile faults the pages back in from the file (they stay in the page cache, which the
    kernel reclaims as it needs). Returns the resident bytes dropped (0 where /proc or
    madvise is absent: Linux only)."""
    mappings = [(address, path, sizes.get("Rss", 0)) for address, perms, path, sizes in _smaps()
                if Path(path).name in COMPILER_LIBRARIES and "w" not in perms
                and not sizes.get("Anonymous", 0) and not sizes.get("Swap", 0)]
    if not mappings:
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    except (OSError, AttributeError):
        return 0
    dropped = 0
    for address, path, rss in mappings:
        start, end = (int(v, 16) for v in address.split("-"))
        if madvise(start, end - start, _MADV_DONTNEED) == 0:
            dropped += rss
        else:
            _LOG.debug("madvise(DONTNEED) of %s at %s failed: %s", path, address,
                       os.strerror(ctypes.get_errno()))
    _LOG.debug("dropped %.1f MiB of the compiler's resident pages", dropped / 2**20)
    return dropped


def loaded_code(path: str) -> None:
    """Note a compiled library the process loaded (compiler/build.py)."""
    _CODE.add(str(path))


def code_bytes() -> int:
    """Resident bytes of the compiled step libraries the process loaded."""
    with _LOCK:
        paths = set(_CODE)
    return _resident_file_bytes(paths)


def overheads() -> Dict[str, int]:
    """The process's memory that is not tensors, for ``stats()``: ``compiled_code_bytes``,
    ``library_bytes`` (the measured loads, summed), ``runtime_bytes`` (the first steps'
    workspaces) and ``allocator_free_bytes``."""
    return {"compiled_code_bytes": code_bytes(), "library_bytes": sum(library_bytes().values()),
            "runtime_bytes": runtime_bytes(), "allocator_free_bytes": allocator_free_bytes()}


TOTAL_KEYS = ("param_bytes", "low_param_bytes", "optimizer_state_bytes", "planned_peak_bytes",
              "compiled_code_bytes", "library_bytes", "runtime_bytes", "allocator_free_bytes")

def with_total(stats: Dict[str, Any]) -> Dict[str, Any]:
    """``stats`` with ``total_bytes``: parameters, optimizer state, the step's planned
    temporaries (the gradients are among them), compiled code, libraries, the runtime's
    first-step workspaces and the allocator's free bytes — what the process's RSS grows by
    from ``import raf_dist`` to training (the measured loads included), the user's own
    tensors aside."""
    return {**stats, "total_bytes": int(sum(int(stats.get(k, 0)) for k in TOTAL_KEYS))}


REPORT_ROWS = (("parameters", "param_bytes"),
               ("16-bit copies of the parameters (mixed precision)", "low_param_bytes"),
               ("optimizer state", "optimizer_state_bytes"),
               ("step temporaries (planned; gradients among them)", "planned_peak_bytes"),
               ("compiled code", "compiled_code_bytes"),
               ("libraries loaded (TVM, torch.export, MPI; pages run)", "library_bytes"),
               ("runtime: threads, BLAS and kernel workspaces", "runtime_bytes"),
               ("allocator's free bytes held (glibc)", "allocator_free_bytes"))


def report(stats: Dict[str, Any], measured_rss: Optional[int] = None,
           baseline_rss: Optional[int] = None) -> str:
    """``stats``'s memory as a table (MiB and share of the total); with the process's RSS
    now and at ``import raf_dist`` (``baseline_rss``), the measured growth beside the total."""
    total = with_total(stats)["total_bytes"]
    lines = [f"{'':52s}{'MiB':>10s}{'share':>8s}"]
    for label, key in REPORT_ROWS:
        value = int(stats.get(key, 0))
        lines.append(f"{label:52s}{value / 2**20:10.1f}{100 * value / max(total, 1):7.1f}%")
    lines.append(f"{'total (predicted growth of the RSS)':52s}{total / 2**20:10.1f}")
    if measured_rss is not None and baseline_rss is not None:
        growth = measured_rss - baseline_rss
        lines.append(f"{'measured RSS growth since import raf_dist':52s}{growth / 2**20:10.1f}"
                     f"{100 * growth / max(total, 1):7.1f}%")
    return "\n".join(lines)


_BASELINE = rss_bytes()  # at import raf_dist (this module is imported first)
_BASE_FILES = _file_rss()  # ~10 ms with PyTorch loaded
_FREE_FLOOR = [_allocator_free()]  # allocator_free_bytes counts the free bytes above it


def baseline_rss() -> int:
    """The RSS when raf_dist was imported."""
    return _BASELINE
