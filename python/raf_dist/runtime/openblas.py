"""numpy's OpenBLAS on TVM's thread pool (the native side is ``src/blas/batched_gemm.cc``,
which says why: two pools on the same cores took turns).

- ``set_threads``: OpenBLAS runs its parallel jobs on TVM's pool through its threads callback
  (OpenBLAS >= 0.3.27, which numpy's wheels ship); ``runtime.threads.set_num_threads`` calls it.
- ``batched_matmul``: numpy runs a stack of matrices one gemm after another on the calling
  thread, and OpenBLAS runs a gemm of at most 65536 x 4 multiply-adds on one thread; a batch of
  such small products is spread over the pool, each one call of numpy's own cblas gemm.

The library is found through threadpoolctl, its functions by address (ctypes): numpy exposes
no C API for its BLAS.
"""
import ctypes
import functools
import logging
import math
import os

import numpy as np
import tvm_ffi

logger = logging.getLogger("raf_dist")


#: OpenBLAS runs a gemm of at most this many multiply-adds on one thread (interface/gemm.c:
#: SMP_THRESHOLD_MIN 65536 x GEMM_MULTITHREAD_THRESHOLD 4); larger ones use its own threads
_SINGLE_THREAD_GEMM = 65536 * 4
_threads = 1


def can_share_pool():
    """Whether host BLAS can run on TVM's pool: numpy's BLAS is an OpenBLAS that takes a
    threads callback (>= 0.3.27) and the native library is built."""
    return _has_native() and _openblas_callback_setter() is not None


def get_threads():
    """The thread count ``set_threads`` was given (1 before)."""
    return _threads


def set_threads(num_threads):
    """Use TVM's pool, of ``num_threads`` (``set_num_threads`` made it), for host BLAS:
    batches of small products are spread over it, and numpy's OpenBLAS runs its parallel jobs
    on it instead of on threads of its own (src/blas/batched_gemm.cc says why: two pools on
    the same cores take turns)."""
    global _threads
    _threads = max(1, int(num_threads))
    if not can_share_pool():
        return
    native = _native_funcs()
    launch = ctypes.cast(_tvm_runtime().TVMBackendParallelLaunch, ctypes.c_void_p).value
    if not native["use_pool"](launch, _threads):
        logger.warning("raf_dist.blas: set_num_threads in a forked child: TVM's pool belongs "
                       "to the parent; BLAS jobs run on threads of their own")
        return
    # OpenBLAS's GEMM jobs wait on each other: hand them over only to a pool that runs that
    # many tasks at once
    on_pool = _threads > 1 and native["pool_tasks"](_threads) == _threads
    native["openblas_on_pool"](_openblas_callback_setter(), on_pool)
    if _threads > 1 and not on_pool:
        logger.warning("raf_dist.blas: TVM's pool did not run %d tasks at once; OpenBLAS "
                       "keeps its own threads", _threads)


def batched_matmul(a, b, out):
    """``out = a @ b`` for a batch of small float matrices on ``_threads`` threads; False (and
    nothing written) when the operands do not qualify: one thread, another dtype, a matrix
    big enough for BLAS's own threads, an operand whose batch or matrix layout no single
    stride describes."""
    if _threads < 2 or out.dtype not in _GEMM_DTYPES or not out.flags.c_contiguous:
        return False
    shape = out.shape
    m, n, k = shape[-2], shape[-1], a.shape[-1]
    batch = math.prod(shape[:-2])
    if batch < 2 or m * n * k > _SINGLE_THREAD_GEMM or a.dtype != out.dtype or \
            b.dtype != out.dtype:
        return False
    gemm = _host_gemm(out.dtype.char)
    if gemm is None:
        return False
    layout_a = _strided_batch(a, shape[:-2])
    layout_b = _strided_batch(b, shape[:-2])
    if layout_a is None or layout_b is None:
        return False
    if not gemm[1] and max(m, n, k, layout_a[0], layout_a[2], layout_b[0], layout_b[2],
                           m * n) >= 2 ** 31:
        return False  # a 32-bit BLAS interface cannot take these sizes and strides
    _run_batched(gemm, a, b, out, layout_a, layout_b)
    return True


def _run_batched(gemm, a, b, out, layout_a, layout_b):
    """``raf_dist.blas.batched_gemm`` on C-contiguous ``out`` of shape (..., m, n) with
    ``gemm`` = (address, ILP64) and the operands' _strided_batch layouts."""
    (m, n), k = out.shape[-2:], a.shape[-1]
    (lda, trans_a, stride_a), (ldb, trans_b, stride_b) = layout_a, layout_b
    _native_funcs()["batched_gemm"](
        gemm[0], gemm[1], out.dtype == np.float64, math.prod(out.shape[:-2]), trans_a, trans_b,
        m, n, k, a.ctypes.data, lda, stride_a, b.ctypes.data, ldb, stride_b, out.ctypes.data, n,
        m * n)


_GEMM_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _strided_batch(x, batch_shape):
    """(leading dimension, transposed, batch stride), in elements, of ``x`` broadcast over
    ``batch_shape`` as one strided batch of BLAS matrices; None when there is none."""
    item = x.itemsize
    rows, cols = x.strides[-2:]
    if cols == item and rows % item == 0 and rows // item >= max(1, x.shape[-1]):
        ld, trans = rows // item, False
    elif rows == item and cols % item == 0 and cols // item >= max(1, x.shape[-2]):
        ld, trans = cols // item, True
    else:
        return None
    # x's batch strides as broadcast over batch_shape: 0 along an axis x lacks or has once
    own = x.strides[:-2]
    pad = len(batch_shape) - len(own)
    strides = [0 if i < pad or x.shape[i - pad] == 1 else own[i - pad]
               for i in range(len(batch_shape))]
    # the batch axes, outermost first, must collapse into one: each axis' stride is the next
    # one's times its length (or every stride is 0, a broadcast operand)
    axes = [(size, stride) for size, stride in zip(batch_shape, strides) if size > 1]
    for (_, outer), (size, inner) in zip(axes, axes[1:]):
        if outer != inner * size:
            return None
    stride = axes[-1][1] if axes else 0
    if stride % item:
        return None
    return ld, trans, stride // item


#: the names numpy's OpenBLAS gives its symbols: (prefix, suffix, 64-bit integers), as the
#: scipy-openblas wheels numpy ships and a plain OpenBLAS do
_OPENBLAS_AFFIXES = (("scipy_", "64_", True), ("scipy_", "", False), ("", "64_", True),
                     ("", "", False))


def _openblas_symbol(name):
    """(address, ILP64) of OpenBLAS's ``name`` (unprefixed, e.g. "cblas_sgemm") in the BLAS
    numpy uses, or None when that is not an OpenBLAS or lacks it."""
    path = _numpy_openblas()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    for prefix, suffix, ilp64 in _OPENBLAS_AFFIXES:
        symbol = f"{prefix}{name}{suffix}"
        if hasattr(lib, symbol):
            return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value, ilp64
    return None


@functools.lru_cache(maxsize=None)
def _numpy_openblas():
    """The file of the OpenBLAS numpy calls: the one inside numpy's installation (its wheels
    bundle it), else the only OpenBLAS loaded; None when numpy's BLAS is another library or
    several OpenBLAS builds are loaded (scipy's, torch's) and none is numpy's own."""
    import threadpoolctl

    paths = [info["filepath"] for info in threadpoolctl.threadpool_info()
             if info.get("user_api") == "blas" and info.get("internal_api") == "openblas"]
    root = os.path.dirname(os.path.dirname(os.path.realpath(np.__file__)))
    own = [p for p in paths if os.path.basename(os.path.dirname(os.path.realpath(p)))
           in ("numpy.libs", ".libs") and os.path.realpath(p).startswith(root)]
    if len(own) == 1:
        return own[0]
    return paths[0] if len(paths) == 1 else None


@functools.lru_cache(maxsize=None)
def _openblas_callback_setter():
    found = _openblas_symbol("openblas_set_threads_callback_function")
    return None if found is None else found[0]


@functools.lru_cache(maxsize=None)
def _host_gemm(char):
    """(address, ILP64) of ``cblas_sgemm`` (char "f") or ``cblas_dgemm`` ("d") of the BLAS
    numpy uses; None when it is not an OpenBLAS, or the native library is missing, or a
    product through it disagrees with numpy's."""
    found = _openblas_symbol("cblas_%sgemm" % {"f": "s", "d": "d"}[char])
    if found is None or not _has_native():
        return None
    if not _agrees_with_numpy(found, np.dtype(char)):
        logger.warning("raf_dist.blas: numpy's OpenBLAS gemm, called directly, disagrees with "
                       "numpy's matmul; batched products stay on numpy")
        return None
    return found


def _agrees_with_numpy(gemm, dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 5, 4)).astype(dtype)
    b = rng.standard_normal((3, 6, 4)).astype(dtype).swapaxes(-1, -2)
    out = np.empty((3, 5, 6), dtype)
    _run_batched(gemm, a, b, out, _strided_batch(a, (3,)), _strided_batch(b, (3,)))
    return np.allclose(out, a @ b, rtol=1e-4, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _tvm_runtime():
    import tvm.libinfo

    return ctypes.CDLL(tvm.libinfo.find_libtvm_runtime())


def _has_native():
    try:
        _native_funcs()
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _native_funcs():
    """The native library's ``raf_dist.blas.*`` functions (ImportError when it was not built)."""
    from .. import _native

    _native.load()
    funcs = {name: tvm_ffi.get_global_func("raf_dist.blas." + name, allow_missing=True)
             for name in ("use_pool", "pool_tasks", "openblas_on_pool",
                          "openblas_pool_launches", "batched_gemm")}
    missing = sorted(name for name, func in funcs.items() if func is None)
    if missing:
        raise ImportError("raf_dist's native library lacks raf_dist.blas." + missing[0] +
                          ": it predates this package; rebuild it with `make install`")
    return funcs
