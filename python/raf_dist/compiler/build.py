"""Compile a training-step module: raf_dist passes, TVM's lowering for the target (CPU with
our schedule, or CUDA with dlight's GPU schedules), memory planning, relax.build — with IR
dumps and an on-disk cache of the built artifact.

Pipeline (in order; each pass's output is dumped to ``$RAF_DIST_DUMP_IR/NN_<pass>.py``):
  1. the caller's passes (distribution, DispatchToBLAS, ...)
  2. TVM library dispatch + LegalizeOps + AnnotateTIROpPattern + FoldConstant + FuseOps + FuseTIR
  3. ScheduleCPU (parallel / vectorised loops for every generated PrimFunc) on the CPU; dlight
     GPU schedules (thread binding for every kernel) on CUDA
  4. TVM dataflow lowering, WriteGradientsIntoBuckets (gradients computed in their bucket),
     UpdateInPlace (new parameters and optimizer state written into the argument buffers),
     then TVM's finalisation (StaticPlanBlockMemory, ...)
  5. relax.build for the target

The cache key is a hash of the module after step 1 (its TVMScript), the target, the TVM and
raf_dist versions and a hash of this package's lowering code; a hit skips steps 2–5.

Steps 2-5 of a CPU build run in a forked child (``_build_in_child``), which writes the library
and its metadata into the cache and exits; this process then loads them as it loads any
cache hit. LLVM's code generation and TVM's lowering need ~100-200 MiB of heap and touch
~90 MiB of the compiler library's code for a transient the training process would otherwise
carry: its construction peak on top of the parameters, and afterwards a heap glibc cannot
return (fragmented by the IR objects that outlive the build). Fork shares every page
copy-on-write, so the child costs no extra copy of what the process holds, and whatever it
allocates leaves with it (TorchInductor compiles in worker processes for the same reason).
A CUDA build stays in the process (a CUDA context does not survive fork), as does every build
where fork is absent or ``RAF_DIST_BUILD_IN_PROCESS`` is set.
"""
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pickle
import sys
import traceback
import warnings
from pathlib import Path

import tvm
import tvm_ffi
from tvm.relax.backend.cpu_generic import pipeline as cpu_pipeline

from .. import env, process_memory
from .._version import __version__
from .inplace_buckets import WriteGradientsIntoBuckets
from .inplace_update import UpdateInPlace
from .memory import planned_bytes
from .schedule_cpu import ScheduleCPU
from .schedule_gpu import ScheduleGPU
from .share_storage import ShareStorageAcrossDtypes

_log = logging.getLogger(__name__)


#: the code that lowers a step after the cache key's module text is taken: this package, the
#: operators' legalisations (the fused cross-entropy's TE kernels are registered with
#: register_legalize and run inside LegalizeOps, after the key) and the passes they share
_LOWERING_SOURCES = ("compiler/*.py", "passes/*.py", "ir/*.py", "training/cross_entropy.py",
                     "training/layer_norm.py")


def _compiler_fingerprint():
    """Hash of the lowering code (_LOWERING_SOURCES): editing it invalidates cached builds."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for pattern in _LOWERING_SOURCES:
        for path in sorted(root.glob(pattern)):
            digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclasses.dataclass
class CompiledStep:
    executable: object  # tvm runtime module for relax.VirtualMachine
    planned_peak_bytes: int  # bytes of the step's planned temporaries (alloc_storage)
    cache_path: str
    cache_hit: bool


@tvm.ir.instrument.pass_instrument
class DumpIR:
    """Writes the module after every pass as TVMScript, one file per pass."""

    def __init__(self, directory, start=0):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.count = start

    def run_after_pass(self, mod, info):
        if info.name in ("sequential", "_pipeline") or info.name.startswith(
                ("tvm.transform", "tirx.", "s_tir.")) or info.name == "NormalizeGlobalVar":
            return
        self.count += 1
        path = self.directory / f"{self.count:02d}_{info.name}.py"
        path.write_text(mod.script(show_meta=False))


def module_key_text(mod):
    """The module as TVMScript plus a digest of every tensor constant's bytes. TVM 0.27's
    ``script(show_meta=True)`` segfaults (in ToJSONGraph) on a module holding a non-scalar
    constant, e.g. a causal-mask buffer imported from PyTorch."""
    digest = hashlib.sha256()

    def visit(expr):
        if isinstance(expr, tvm.ir.expr.GenericConst):
            value = expr.value
            if not hasattr(value, "numpy"):  # a scalar the script already spells out
                digest.update(str(value).encode())
                return
            data = value.numpy()
            digest.update(f"{data.dtype}{data.shape}".encode())
            digest.update(data.tobytes())

    for _, func in sorted(mod.functions_items(), key=lambda item: item[0].name_hint):
        if isinstance(func, tvm.relax.Function):
            tvm.relax.analysis.post_order_visit(func, visit)
    return mod.script(show_meta=False) + "\nconstants " + digest.hexdigest()


def default_cache_dir():
    return Path(env.cache_dir())


def make_target(target):
    """A tvm Target from "llvm" (for this machine's CPU), "cuda" (for the GPU of this
    machine, else $RAF_DIST_CUDA_ARCH or sm_80, with an LLVM host), a JSON-style dict, or a
    Target."""
    if isinstance(target, tvm.target.Target):
        return target
    if target == "cuda":
        arch = env.cuda_arch()
        if arch is None and tvm.cuda(0).exist:
            arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "")
        return tvm.target.Target({"kind": "cuda", "arch": arch or "sm_80"}, host="llvm")
    if target == "llvm":  # this machine's CPU, as the Trainer builds (device.host_target)
        from ..device import host_target

        return tvm.target.Target(host_target())
    return tvm.target.Target(target)


@tvm.transform.module_pass(opt_level=0, name="DropScopePragma")
class DropScopePragma:
    """Removes the ``pragma_scope`` attribute TVM's IR builder wraps around a sequence of loops
    (``T.seq_scope()``, in take_backward and the scatter kernels). It only told the builder
    to accept several statements; the LLVM code generator does not know it and warned
    "Unknown pragma pragma_scope" on every CPU build of a model with an embedding."""

    def transform_module(self, mod, ctx):
        def drop(stmt):
            return stmt.body if stmt.attr_key == "pragma_scope" else stmt

        updates = {gvar: func.with_body(tvm_ffi.structural_map(
                       func.body, [(tvm.tirx.AttrStmt, drop)]))
                   for gvar, func in mod.functions_items() if isinstance(func, tvm.tirx.PrimFunc)}
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def _pipeline(target):
    """TVM's backend pipeline for the target and the passes that schedule generated kernels:
    ScheduleCPU on the CPU; on CUDA, ScheduleGPU (dlight's default GPU rules, as TVM's CUDA
    pipeline applies them, but skipping a rule that fails on a kernel)."""
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline
        legalize = pipeline.legalize_passes(target)  # ends with dlight's ApplyDefaultSchedule
        return pipeline, legalize[:-1] + [ScheduleGPU()]
    return cpu_pipeline, cpu_pipeline.legalize_passes(target) + [ScheduleCPU(), DropScopePragma()]


def lower_and_plan(mod, target, instruments=()):
    """Steps 2-4 up to memory planning: the module StaticPlanBlockMemory leaves (gradients
    already redirected into their buckets by WriteGradientsIntoBuckets, so not planned)."""
    pipeline, legalize = _pipeline(target)
    finalize = pipeline.finalize_passes(target)  # [StaticPlanBlockMemory, lowering...]
    with target, tvm.transform.PassContext(opt_level=3, instruments=list(instruments)):
        return tvm.transform.Sequential(
            pipeline.library_dispatch_passes(target) + legalize
            + pipeline.dataflow_lower_passes(target)
            + [WriteGradientsIntoBuckets(), UpdateInPlace()] + finalize[:1]
            + [ShareStorageAcrossDtypes()])(mod)


def apply_passes(mod, passes):
    """``mod`` through ``passes`` in order, under the PassContext every build uses."""
    with tvm.transform.PassContext(opt_level=3):
        for p in passes:
            mod = p(mod)
    return mod


def planned_module(mod, passes=(), target="llvm"):
    """``mod`` after ``passes`` and the pipeline up to memory planning, without building."""
    return lower_and_plan(apply_passes(mod, passes), make_target(target))


def plan_memory(mod, passes=(), target="llvm"):
    """Bytes of the step's planned temporaries (what ``CompiledStep.planned_peak_bytes``
    reports) without building: the passes, then the pipeline up to memory planning."""
    return planned_bytes(planned_module(mod, passes, target))


def compile_step(mod, passes=(), target="llvm", cache_dir=None, dump_dir=None):
    """Run ``passes`` then the target's pipeline on ``mod`` and build it (or load it from
    cache). ``target``: see ``make_target``."""
    dump_dir = dump_dir if dump_dir is not None else env.dump_ir_dir()
    instruments = [DumpIR(dump_dir)] if dump_dir else []
    target = make_target(target)
    with tvm.transform.PassContext(opt_level=3, instruments=instruments):
        for p in passes:
            mod = p(mod)
    # strictness is part of the key: a step built leniently (kernels left unscheduled) must
    # not satisfy a strict build from the cache
    key_text = "\n".join([module_key_text(mod), str(target), tvm.__version__, __version__,
                          _compiler_fingerprint(), f"strict={env.strict_schedules()}"])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    lib_path = cache / f"step-{key}.so"
    meta_path = cache / f"step-{key}.json"
    hit = _load_cached(lib_path, meta_path)
    if hit is not None:
        return hit
    cache.mkdir(parents=True, exist_ok=True)
    # ranks of one job that build the same step (every dp rank, every tp rank of a layer's
    # split, the microbatch variants) take turns: the first builds, the others load its library
    with build_lock(cache / f"step-{key}.lock"):
        hit = _load_cached(lib_path, meta_path)
        if hit is not None:
            return hit
        if (target.kind.name == "cuda" or not hasattr(os, "fork")
                or sys.platform != "linux" or env.build_in_process()):
            return _build(mod, target, instruments, lib_path, meta_path)
        _build_in_child(mod, target, instruments, lib_path, meta_path)
        return dataclasses.replace(_load_cached(lib_path, meta_path), cache_hit=False)


def _load_cached(lib_path, meta_path):
    if not (lib_path.exists() and meta_path.exists()):
        return None
    meta = json.loads(meta_path.read_text())
    process_memory.loaded_code(str(lib_path))
    return CompiledStep(tvm.runtime.load_module(str(lib_path)), meta["planned_peak_bytes"],
                        str(lib_path), True)


@contextlib.contextmanager
def build_lock(path):
    """An exclusive ``flock`` on ``path`` for the duration of one build. N ranks on one host
    that miss the cache together would otherwise each compile the same module (on a 2-core
    host, 4 ranks took twice one build's time); the kernel releases the lock when its holder
    exits, so a rank killed mid-build never blocks the others. Where the filesystem refuses
    ``flock`` (some network mounts) every rank builds, as before."""
    with open(path, "a") as handle:
        locked = True
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.debug("waiting for another process's build of %s", path.stem)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _build_in_child(mod, target, instruments, lib_path, meta_path):
    """``_build`` in a forked child that writes the library and its metadata and exits (the
    module docstring says why). The child runs the compiler alone on its one thread: it runs
    no kernel (TVM's and OpenMP's thread pools are not needed), makes no MPI call, and leaves
    with ``os._exit`` (no atexit handler, no MPI_Finalize, no flush of buffers it inherited).
    An exception in the child is raised here as it was raised there (its traceback attached);
    a child killed by a signal (a crash in the compiler, the OOM killer) is a RuntimeError
    naming it."""
    sys.stdout.flush()  # what this process printed is not printed again by the child
    sys.stderr.flush()
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python >= 3.12 warns on fork in a threaded process;
        warnings.simplefilter("ignore", DeprecationWarning)  # the child only compiles
        pid = os.fork()
    if pid == 0:  # the build process
        os.close(read)
        code = 0
        try:
            _build(mod, target, instruments, lib_path, meta_path, load=False)
        except BaseException as exc:  # noqa: B036 -- reported to the parent, whatever it is
            code = 1
            text = traceback.format_exc()
            try:
                payload = pickle.dumps((exc, text))
                pickle.loads(payload)  # (an exception whose __init__ takes other arguments)
            except Exception:  # an exception that does not pickle arrives as its text
                payload = pickle.dumps((None, text))
            with os.fdopen(write, "wb") as pipe:
                pipe.write(payload)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        payload = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        raise RuntimeError(
            f"the build process compiling {lib_path.name} was killed by signal "
            f"{os.WTERMSIG(status)} (a crash in the compiler, or out of memory); set "
            "RAF_DIST_BUILD_IN_PROCESS=1 to compile in this process and see where")
    if payload:
        exc, text = pickle.loads(payload)
        if exc is None:
            raise RuntimeError(f"compiling {lib_path.name} failed in the build process:\n{text}")
        raise exc from RuntimeError(f"in the build process:\n{text}")
    if os.WEXITSTATUS(status) != 0 or not (lib_path.exists() and meta_path.exists()):
        raise RuntimeError(f"the build process compiling {lib_path.name} exited with status "
                           f"{os.WEXITSTATUS(status)} and wrote no library")


def _build(mod, target, instruments, lib_path, meta_path, load=True):
    if target.kind.name == "cuda":  # TVM reads its kernel compiler from the environment
        from ..device import cuda_compiler
        os.environ.setdefault("TVM_CUDA_COMPILE_MODE", cuda_compiler() or "nvrtc")
    planned = lower_and_plan(mod, target, instruments)
    peak = planned_bytes(planned)
    with target, tvm.transform.PassContext(opt_level=3, instruments=instruments):
        lowered = tvm.transform.Sequential(_pipeline(target)[0].finalize_passes(target)[1:])(planned)
    with target, tvm.transform.PassContext(opt_level=3):
        executable = tvm.compile(lowered, target=target, relax_pipeline=None)
    tmp = lib_path.with_suffix(f".tmp{os.getpid()}.so")
    executable.export_library(str(tmp))
    os.replace(tmp, lib_path)  # atomic: concurrent ranks never load a half-written library
    meta_tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
    meta_tmp.write_text(json.dumps({"planned_peak_bytes": peak, "target": str(target)}))
    os.replace(meta_tmp, meta_path)
    if not load:  # (the build process: its parent loads the library)
        return None
    process_memory.loaded_code(str(lib_path))
    if target.kind.name == "cuda":  # (a CUDA library loads only where a CUDA runtime is)
        return CompiledStep(executable, peak, str(lib_path), False)
    # run the library just written, as a cache hit would: the in-memory executable holds
    # the build's intermediate modules, which the process would keep for its lifetime
    del executable, lowered, planned
    return CompiledStep(tvm.runtime.load_module(str(lib_path)), peak, str(lib_path), False)
