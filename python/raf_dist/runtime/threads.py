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

logger = logging.getLogger("raf_dist")


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, which a launcher or container sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def set_num_threads(num_threads: int) -> None:
    """Size TVM's pool (it defaults to one thread here) and numpy's BLAS to ``num_threads``.

    Idle TVM workers sleep instead of spinning (TVM_THREAD_POOL_SPIN_COUNT=0 unless the user
    set it): spinning workers steal the cores from the MPI communication thread, from BLAS and
    from whatever runs between steps. Threads are not bound to cores (TVM_BIND_THREADS=0
    unless the user set it; see the module docstring), and the calling thread's affinity is
    restored in any case, so the process keeps every core it had.
    """
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    # TVM reads this each time it (re)configures its pool, also lazily at the first parallel
    # kernel, so it must stay in the environment rather than be set around one call
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    affinity = _affinity()
    tvm.get_global_func("runtime.config_threadpool")(1, int(num_threads))
    if affinity is not None and _affinity() != affinity:
        # only when the user asked for binding (TVM_BIND_THREADS=1): TVM's workers stay bound,
        # the user's thread gets its cores back
        logger.info("TVM bound the calling thread to cores %s; restoring %s",
                    sorted(_affinity()), sorted(affinity))
        os.sched_setaffinity(0, affinity)
    threadpoolctl.threadpool_limits(limits=int(num_threads), user_api="blas")


def _affinity():
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - non-Linux
        return None
