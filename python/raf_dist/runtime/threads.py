"""Compute thread pools: TVM's and the BLAS library numpy uses, sized per rank, never pinned.

TVM's `runtime.config_threadpool` binds the *calling* thread to core 0 (and its workers to the
following cores) unless ``TVM_BIND_THREADS=0``. Called from the main thread that pins the
user's process: every rank of a job on one host computed on core 0, and threads the user
starts afterwards (PyTorch's OpenMP pool, data loaders) inherited the pin — measured in
bench/RESULTS.md ("thread placement"): 2-rank GPT data-parallel step 90 -> 49 ms without it.
raf_dist therefore never changes affinity: the operating system places the threads inside
whatever CPU set the process was given (by the launcher, a container, ``taskset``). Ranks on
one host avoid oversubscription by thread count (cores / local ranks), not by pinning; the
alternative — disjoint core sets per local rank — measured no faster (bench/RESULTS.md).
"""
import logging
import os

import threadpoolctl
import tvm

from . import openblas

logger = logging.getLogger("raf_dist")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which a launcher or container sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def threads_per_rank(local_ranks: int) -> int:
    """The compute threads of each of ``local_ranks`` ranks on this host: its cores shared
    out, at least one (module docstring)."""
    return max(1, available_cores() // max(1, local_ranks))


#: Rounds an idle TVM worker spins before it sleeps when a second pool (PyTorch's OpenMP team,
#: asleep when idle) runs the 16-bit GEMMs on the same cores. Each round is a
#: ``sched_yield`` (tvm/src/runtime/thread_pool.cc, ``SpscTaskQueue::Pop``), so a spinning
#: worker gives its core to a GEMM thread that wakes, yet is awake for the next parallel
#: kernel: without spinning every parallel kernel first wakes a sleeping worker. Measured on
#: bench/mixed_precision.py's bf16 GPT (2-core Xeon with AMX, medians of 10 steps, alternating
#: runs): 0 rounds 40.1-46.3 ms, 1000: 35.5-38.0, 3000: 32.0-36.3, 5000: 34.4-34.5,
#: 10000: 32.1-38.2, 100000: 36.1, TVM's 300000: 36.8-38.9; the 23M GEMM GPT 286 ms at 0,
#: 254-273 at 3000.
#: (With libgomp's team spinning too, as before raf_dist asked it to sleep, both pools took
#: turns: 173 ms.) float32 steps keep TVM's default (44-45 ms either way).
SECOND_POOL_SPIN_COUNT = 3000


def set_num_threads(num_threads: int, second_pool: bool = False) -> None:
    """Size TVM's pool and numpy's BLAS to ``num_threads``, one pool for both where the BLAS
    allows it (``openblas.set_threads``).

    TVM makes its pool once per thread, with ``TVM_NUM_THREADS`` workers (else half the
    hardware threads: 1 on a 2-core machine), and runs every kernel on the calling thread alone
    while that number is 1: ``config_threadpool``'s count only chooses how many of the made
    workers to use (tvm/src/runtime/thread_pool.cc: ``ThreadPool()``, ``Configure``,
    ``TVMBackendParallelLaunch``). So ``TVM_NUM_THREADS`` is set first; until it was, every
    kernel here ran on one thread (the GPT step 51 -> 42 ms with it and the shared pool).

    Idle TVM workers spin for a while before they sleep (TVM's default, 300000 rounds), as an
    OpenMP pool does, when the BLAS runs its jobs on that pool; else they sleep at once
    (TVM_THREAD_POOL_SPIN_COUNT=0): spinning next to the BLAS's own spinning threads took the
    GPT step from 52 to 120 ms. When ``second_pool`` — another runtime's pool computes on the
    same cores (a 16-bit step's GEMMs in PyTorch's oneDNN, on its OpenMP team, runtime/blas.py;
    ``raf_dist`` asks that team to sleep when idle) — they spin ``SECOND_POOL_SPIN_COUNT``
    rounds (see there). TVM reads the count when its pool first runs, so this holds for the
    process. A value the user set wins in every case. Threads are not bound
    to cores (TVM_BIND_THREADS=0 unless the user set it; see the module docstring), and the
    calling thread's affinity is restored in any case, so the process keeps every core it had.
    """
    num_threads = max(1, int(num_threads))
    if second_pool:
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(SECOND_POOL_SPIN_COUNT))
    elif not openblas.can_share_pool():
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    # TVM reads this each time it (re)configures its pool, also lazily at the first parallel
    # kernel, so it must stay in the environment rather than be set around one call
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    # read when the pool is made (below, unless a kernel made it before) and at every launch
    os.environ["TVM_NUM_THREADS"] = str(num_threads)
    affinity = _affinity()
    tvm.get_global_func("runtime.config_threadpool")(1, num_threads)
    pool = tvm.get_global_func("runtime.NumThreads")()
    if pool != num_threads:
        logger.warning("TVM's thread pool has %d threads, not %d: it was made (by a kernel "
                       "run before set_num_threads) with fewer; set TVM_NUM_THREADS=%d before "
                       "the first kernel", pool, num_threads, num_threads)
    if affinity is not None and _affinity() != affinity:
        # only when the user asked for binding (TVM_BIND_THREADS=1): TVM's workers stay bound,
        # the user's thread gets its cores back
        logger.info("TVM bound the calling thread to cores %s; restoring %s",
                    sorted(_affinity()), sorted(affinity))
        os.sched_setaffinity(0, affinity)
    threadpoolctl.threadpool_limits(limits=pool, user_api="blas")
    openblas.set_threads(pool)


def _affinity():
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - non-Linux
        return None
