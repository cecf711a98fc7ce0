"""``raf_dist.blas.matmul(a, b, trans_a, trans_b, out)``: numpy's BLAS on zero-copy views.

numpy hands a transposed view of a contiguous matrix to gemm as a transpose flag, so folded
transposes cost nothing; batched operands (rank > 2, broadcasting like np.matmul) run one gemm
per matrix.
"""
import numpy as np
import tvm_ffi

BLAS_MATMUL = "raf_dist.blas.matmul"


def matmul(a, b, trans_a, trans_b, out):
    a = np.from_dlpack(a)
    b = np.from_dlpack(b)
    if trans_a:
        a = np.swapaxes(a, -1, -2)
    if trans_b:
        b = np.swapaxes(b, -1, -2)
    np.matmul(a, b, out=np.from_dlpack(out))


tvm_ffi.register_global_func(BLAS_MATMUL, matmul, override=True)
