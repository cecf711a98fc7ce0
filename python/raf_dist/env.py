"""The RAF_DIST_* environment variables that switch raf_dist's diagnostics, parsed and
validated here (the one place that reads them) so that a typo in a value fails at once with
the allowed values instead of being read as "off".

  RAF_DIST_STRICT_SCHEDULE=1   a kernel the CPU schedule cannot handle raises
                               (ScheduleFallbackError) instead of being logged and left
                               unscheduled; the test suite runs this way (tests/conftest.py)
  RAF_DIST_NO_SCHEDULE=1       skip the CPU schedule altogether (every kernel serial; for
                               measuring what the schedule gains)
  RAF_DIST_PROFILE=dir         every Trainer records its first RAF_DIST_PROFILE_STEPS steps
                               (default 10) and writes them as a Chrome trace to
                               ``dir/trace-rank{R}.json`` (Trainer.profile, raf_dist.profiler)
  RAF_DIST_COLLECTIVE_TIMEOUT_S=600  seconds a collective may wait before raising TimeoutError
                               (default 600; 0 or none: wait forever)
  RAF_DIST_BARRIER_TIMEOUT_S=3600    seconds Communicator.idle_barrier and .agree (the
                               barriers and agreements around compilation and checkpoint
                               I/O) may wait (default 3600; 0 or none: wait forever)
  RAF_DIST_CHECK_COLLECTIVES=1 ranks compare every collective's signature before it runs
  RAF_DIST_WATCHDOG=0          no per-rank watchdog process (default on)
  RAF_DIST_WATCHDOG_GRACE_S=10 seconds a watchdog lets the launcher end its rank after a
                               failure elsewhere before it terminates the rank
  RAF_DIST_LOW_GEMM=widen      bf16 / fp16 matmuls on the host: "native" (oneDNN's 16-bit
                               GEMM) or "widen" (float32 GEMM of widened operands); unset:
                               the faster, measured once per process (runtime/blas.py)
  RAF_DIST_ONE_THREAD_GEMM_MFLOP=64  16-bit host GEMMs below this run on the calling thread
                               alone, not PyTorch's sleeping OpenMP team (runtime/blas.py)
  RAF_DIST_CUDA_GEMM=cupy      GPU matmuls through cupy.matmul instead of one direct
                               cuBLAS call each (default "cublas"; runtime/cublas.py)

The five failure-handling settings (timeouts, collective checks, watchdog) are also fields of
``dist.get_config()`` (collective_timeout_s, ...); the environment variable, when set,
overrides the field (``raf_dist.distributed.settings`` reads them with ``seconds`` and
``switch`` below, the config's values as defaults).

The README lists every RAF_DIST_* variable, including the few read elsewhere (launcher
variables set by ``raf_dist.run``, build settings).
"""
import os
import sys


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def switch(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a switch: set it to one of "
                     f"{', '.join(_TRUE)} (on) or {', '.join(repr(v) for v in _FALSE)} (off)")


def strict_schedules() -> bool:
    """RAF_DIST_STRICT_SCHEDULE: a scheduling fallback raises instead of logging."""
    return switch("RAF_DIST_STRICT_SCHEDULE")


def build_in_process() -> bool:
    """RAF_DIST_BUILD_IN_PROCESS: compile a step in this process rather than in a forked
    build process (compiler/build.py), e.g. to step through the passes in a debugger."""
    return switch("RAF_DIST_BUILD_IN_PROCESS")


def skip_schedules() -> bool:
    """RAF_DIST_NO_SCHEDULE: leave every generated kernel unscheduled."""
    return switch("RAF_DIST_NO_SCHEDULE")


def profile_dir() -> "str | None":
    """RAF_DIST_PROFILE: the directory every Trainer writes its per-rank trace to, or None."""
    value = os.environ.get("RAF_DIST_PROFILE", "").strip()
    return value or None


def cache_dir() -> str:
    """RAF_DIST_CACHE_DIR: where compiled steps are cached (default
    ``$XDG_CACHE_HOME/raf_dist``, ``~/.cache/raf_dist``)."""
    value = os.environ.get("RAF_DIST_CACHE_DIR", "").strip()
    if value:
        return value
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(base, "raf_dist")


def dump_ir_dir() -> "str | None":
    """RAF_DIST_DUMP_IR: a directory each compilation writes the IR after every pass to."""
    value = os.environ.get("RAF_DIST_DUMP_IR", "").strip()
    return value or None


def cuda_arch() -> "str | None":
    """RAF_DIST_CUDA_ARCH (e.g. sm_90): the GPU architecture to compile for when this
    machine has no GPU to ask."""
    value = os.environ.get("RAF_DIST_CUDA_ARCH", "").strip()
    return value or None


def library_path() -> "str | None":
    """RAF_DIST_LIBRARY_PATH: the native library (``libraf_dist.so``) or its directory,
    instead of the one built into the package."""
    value = os.environ.get("RAF_DIST_LIBRARY_PATH", "").strip()
    return value or None


_DEFAULT_PROFILE_STEPS = 10  # enough to see the first step's warm-up and a few steady ones


def one_thread_gemm_flops(default: float) -> float:
    """RAF_DIST_ONE_THREAD_GEMM_MFLOP: 16-bit host GEMMs below this many MFLOP run on the
    calling thread alone (runtime/blas.py); 0 sends every GEMM to PyTorch's team."""
    value = os.environ.get("RAF_DIST_ONE_THREAD_GEMM_MFLOP", "").strip()
    if not value:
        return default
    try:
        mflop = float(value)
    except ValueError:
        mflop = -1.0
    if not mflop >= 0:
        raise ValueError(f"RAF_DIST_ONE_THREAD_GEMM_MFLOP={value!r}: give a number of MFLOP "
                         ">= 0 (0: every 16-bit GEMM on PyTorch's threads), or unset it")
    return mflop * 1e6


def low_gemm() -> "str | None":
    """RAF_DIST_LOW_GEMM: "native" or "widen", how 16-bit matmuls run on the host
    (runtime/blas.py ``low_gemm_mode``); unset: measured once per process."""
    value = os.environ.get("RAF_DIST_LOW_GEMM", "").strip().lower()
    if value and value not in ("native", "widen"):
        raise ValueError(f"RAF_DIST_LOW_GEMM={value!r}: set it to 'native' or 'widen', or "
                         "unset it to measure")
    return value or None


def cuda_gemm() -> str:
    """RAF_DIST_CUDA_GEMM: "cublas" (default: one cublasGemmStridedBatchedEx per GPU matmul,
    runtime/cublas.py) or "cupy" (cupy.matmul)."""
    value = os.environ.get("RAF_DIST_CUDA_GEMM", "").strip().lower() or "cublas"
    if value not in ("cublas", "cupy"):
        raise ValueError(f"RAF_DIST_CUDA_GEMM={value!r}: set it to 'cublas' or 'cupy'")
    return value


def profile_steps() -> int:
    """RAF_DIST_PROFILE_STEPS: how many steps RAF_DIST_PROFILE records (a positive integer)."""
    value = os.environ.get("RAF_DIST_PROFILE_STEPS", "").strip()
    if not value:
        return _DEFAULT_PROFILE_STEPS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"RAF_DIST_PROFILE_STEPS={value!r}: give a positive number of steps "
                         f"(default {_DEFAULT_PROFILE_STEPS})")
    return int(value)


_NO_TIMEOUT = ("0", "none", "off", "inf")


def seconds(name: str, default: float) -> "float | None":
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default or None  # a config field of 0: forever
    if value in _NO_TIMEOUT:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name}={os.environ[name]!r} is not a timeout: give a number of seconds "
                         f"(default {default:g}), or 0 / none to wait forever")
    return seconds


def _passive_openmp() -> bool:
    """Ask OpenMP's idle threads to sleep (OMP_WAIT_POLICY=PASSIVE) when torch, whose
    libgomp reads the variable once as it loads, is not imported yet and the user set no
    policy; True when torch's OpenMP team sleeps (or will)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


#: PyTorch's OpenMP team runs a 16-bit step's GEMMs on the host (runtime/blas.py), between
#: TVM's kernels on the same cores; spinning there it slowed the bf16 GPT step of
#: bench/mixed_precision.py from 37 to 49 ms. Decided when raf_dist is imported (below).
TORCH_OPENMP_PASSIVE = _passive_openmp()
