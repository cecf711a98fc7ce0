"""GPU matmuls straight to cuBLAS: one ``cublasGemmStridedBatchedEx`` on the step's own device
pointers, through CuPy's thin binding of it (``cupy_backends.cuda.libs.cublas``) and CuPy's
per-device handle, on CuPy's current stream (the legacy default stream, as TVM's kernels).

Why not ``cupy.matmul``: it builds an ndarray per operand from DLPack, checks and broadcasts
them, then calls the same cuBLAS — about 60 us of host time per product on an H200, which
made the GPT step of bench/step_time.py host-bound (bench/RESULTS.md). Here the call's
arguments are computed once per (shapes, transposes) (``plan``) and the product is one
binding call. Where one strided-batched call cannot express the product (a broadcast other
than a whole operand shared by the batch, a non-contiguous operand, another dtype) or CuPy's
binding is missing, ``matmul`` returns False and ``raf_dist.blas`` runs CuPy's matmul.
RAF_DIST_CUDA_GEMM=cupy turns this path off.

cuBLAS is column-major: a row-major (r, c) matrix is its column-major transpose with leading
dimension c, so ``out = op(a) @ op(b)`` is computed as ``out^T = op(b)^T @ op(a)^T``: b is
cuBLAS's first operand and a its second (derivation in ``plan``).
"""
import dataclasses
import functools
import logging
import math
from typing import Optional, Tuple

import numpy as np

from .. import env

logger = logging.getLogger("raf_dist")

DATA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}  # cudaDataType_t
COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: float32 accumulation, no TF32 (CuPy's and torch's default)
GEMM_DEFAULT = -1  # CUBLAS_GEMM_DEFAULT
OP_N, OP_T = 0, 1
_INT_MAX = 2**31 - 1
_ONE = np.ones((), np.float32)  # alpha and beta, read from host memory (the default pointer
_ZERO = np.zeros((), np.float32)  # mode) in the compute type's precision


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """The column-major call: ``C (m x n) = op_first(first) @ op_second(second)``, ``batch``
    times, each operand advanced by its stride (0: shared by the whole batch)."""

    op_first: int  # on b's memory
    op_second: int  # on a's memory
    m: int
    n: int
    k: int
    ld_first: int
    ld_second: int
    ldc: int
    stride_first: int
    stride_second: int
    stride_c: int
    batch: int


def _strip_ones(shape):
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


@functools.lru_cache(maxsize=4096)
def plan(a_shape: Tuple[int, ...], b_shape: Tuple[int, ...], out_shape: Tuple[int, ...],
         trans_a: bool, trans_b: bool) -> Optional[GemmPlan]:
    """cuBLAS's arguments for ``out = op(a) @ op(b)`` on contiguous row-major operands, or None
    where one strided-batched call cannot express it.

    a's memory, (M, K) row-major (or (K, M) when ``trans_a``), is column-major (K, M) = a^T
    with leading dimension K (or column-major (M, K) = a with leading dimension M, which
    ``OP_T`` turns into a^T). Likewise b's memory gives b^T (N, K) directly (leading
    dimension N) or through ``OP_T`` (leading dimension K). cuBLAS then computes
    ``(N x M) = b^T @ a^T`` into out's memory with leading dimension N: out in row-major.

    Batches: every operand's batch (its leading axes) either equals out's or has one element
    (that operand shared: stride 0). A shared b with an untransposed a folds the batch into
    M: one larger product instead of a batch of small ones."""
    if min(len(a_shape), len(b_shape), len(out_shape)) < 2:
        return None
    m, n = out_shape[-2:]
    a_m, k = (a_shape[-1], a_shape[-2]) if trans_a else (a_shape[-2], a_shape[-1])
    b_k, b_n = (b_shape[-1], b_shape[-2]) if trans_b else (b_shape[-2], b_shape[-1])
    if (a_m, b_k, b_n) != (m, k, n) or 0 in (m, n, k):
        return None
    batch_shape = _strip_ones(out_shape[:-2])
    batch = math.prod(batch_shape)

    def stride(shape, size):
        own = _strip_ones(shape[:-2])
        if not own:
            return 0
        return size if own == batch_shape else None

    stride_a, stride_b = stride(a_shape, m * k), stride(b_shape, k * n)
    if stride_a is None or stride_b is None:
        return None
    if batch > 1 and stride_b == 0 and stride_a and not trans_a:
        m, batch, stride_a = m * batch, 1, 0  # a's rows of every batch are one (B*M, K)
    if max(m, n, k, batch) > _INT_MAX:  # the binding's (and cuBLAS's) int arguments
        return None
    return GemmPlan(op_first=OP_T if trans_b else OP_N, op_second=OP_T if trans_a else OP_N,
                    m=n, n=m, k=k, ld_first=k if trans_b else n, ld_second=m if trans_a else k,
                    ldc=n, stride_first=stride_b, stride_second=stride_a, stride_c=m * n,
                    batch=batch)


_library: list = []  # [(cupy's cublas binding, get_cublas_handle, its error) or None]


def _binding():
    if not _library:
        found = None
        if env.cuda_gemm() == "cublas":
            try:
                from cupy.cuda import device
                from cupy_backends.cuda.libs import cublas
                found = (cublas.gemmStridedBatchedEx, device.get_cublas_handle,
                         cublas.CUBLASError)
            except (ImportError, AttributeError) as e:
                logger.warning("raf_dist.blas: CuPy's cuBLAS binding is missing (%s); GPU "
                               "matmuls go through cupy.matmul", e)
        _library.append(found)
    return _library[0]


def matmul(a, b, trans_a, trans_b, out) -> bool:
    """``out = op(a) @ op(b)`` by one cuBLAS call; False (nothing done) where this path does
    not apply (see the module docstring)."""
    dtype = str(a.dtype)
    if dtype not in DATA_TYPES or str(b.dtype) != dtype or str(out.dtype) not in (
            dtype, "float32"):
        return False
    if not (a.is_contiguous() and b.is_contiguous() and out.is_contiguous()):
        return False
    p = plan(tuple(a.shape), tuple(b.shape), tuple(out.shape), bool(trans_a), bool(trans_b))
    binding = _binding() if p is not None else None
    if binding is None:
        return False
    gemm, handle, error = binding
    t = DATA_TYPES[dtype]
    try:
        gemm(handle(), p.op_first, p.op_second, p.m, p.n, p.k, _ONE.ctypes.data,
             b.data_ptr(), t, p.ld_first, p.stride_first,
             a.data_ptr(), t, p.ld_second, p.stride_second,
             _ZERO.ctypes.data, out.data_ptr(), DATA_TYPES[str(out.dtype)], p.ldc, p.stride_c,
             p.batch, COMPUTE_32F, GEMM_DEFAULT)
    except error as e:  # a combination this cuBLAS does not support: cupy.matmul's way
        logger.debug("raf_dist.blas: cublasGemmStridedBatchedEx declined %s: %s", p, e)
        return False
    return True
