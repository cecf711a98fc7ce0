"""Unit tier for the direct cuBLAS matmul (runtime/cublas.py) without a GPU: the column-major
arguments ``plan`` derives for a row-major product (transposes, batches, a shared operand, the
folded batch) are run through a numpy model of cublasGemmStridedBatchedEx on the operands'
flat memory and must give numpy's matmul; and ``matmul`` hands that call its arguments in the
order of CuPy 14.2's binding, on the tensors' own pointers (host tensors here, read back
through ctypes). tests/gpu runs the real call against the CPU step."""
import ctypes

import numpy as np
import pytest
import tvm

from raf_dist.runtime import cublas


def _column_major(memory, offset, rows, cols, ld):
    """The column-major (rows x cols) matrix at ``memory[offset:]`` with leading dimension ld."""
    i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return memory[offset + i + j * ld]


def _gemm_strided_batched(p, first, second, c):
    """cuBLAS's C = op(first) @ op(second) per batch entry, on flat memory (float64 here)."""
    for index in range(p.batch):
        f = (_column_major(first, index * p.stride_first, p.m, p.k, p.ld_first)
             if p.op_first == cublas.OP_N else
             _column_major(first, index * p.stride_first, p.k, p.m, p.ld_first).T)
        s = (_column_major(second, index * p.stride_second, p.k, p.n, p.ld_second)
             if p.op_second == cublas.OP_N else
             _column_major(second, index * p.stride_second, p.n, p.k, p.ld_second).T)
        i, j = np.meshgrid(np.arange(p.m), np.arange(p.n), indexing="ij")
        c[index * p.stride_c + i + j * p.ldc] = f @ s


CASES = [  # a's shape, b's shape (as stored), trans_a, trans_b
    ((5, 3), (3, 4), False, False),
    ((3, 5), (3, 4), True, False),
    ((5, 3), (4, 3), False, True),
    ((3, 5), (4, 3), True, True),
    ((2, 6, 5, 3), (2, 6, 3, 4), False, False),  # the attention's per-head products
    ((2, 6, 5, 3), (2, 6, 4, 3), False, True),
    ((2, 6, 3, 5), (2, 6, 3, 4), True, False),
    ((2, 7, 3), (3, 4), False, False),  # activations x a weight: the batch folded into M
    ((2, 7, 3), (4, 3), False, True),
    ((2, 3, 7), (3, 4), True, False),  # transposed activations: a batch over a shared weight
    ((5, 3), (2, 3, 4), False, False),  # a shared by b's batch
    ((1, 2, 5, 3), (2, 3, 4), False, False),  # leading ones broadcast away
]


@pytest.mark.parametrize("a_shape, b_shape, trans_a, trans_b", CASES)
def test_plan_gives_numpys_product(a_shape, b_shape, trans_a, trans_b):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    expected = np.matmul(np.swapaxes(a, -1, -2) if trans_a else a,
                         np.swapaxes(b, -1, -2) if trans_b else b)
    p = cublas.plan(a.shape, b.shape, expected.shape, trans_a, trans_b)
    assert p is not None
    c = np.full(expected.size, np.nan)
    _gemm_strided_batched(p, b.ravel(), a.ravel(), c)
    np.testing.assert_allclose(c.reshape(expected.shape), expected, rtol=1e-12, atol=1e-12)


def test_the_shared_weight_folds_the_batch_into_one_product():
    p = cublas.plan((2, 7, 3), (3, 4), (2, 7, 4), False, False)
    assert (p.batch, p.n, p.stride_second) == (1, 14, 0)


@pytest.mark.parametrize("a_shape, b_shape, out_shape", [
    ((2, 1, 5, 3), (1, 6, 3, 4), (2, 6, 5, 4)),  # both broadcast: no single strided batch
    ((2, 5, 3), (3, 3, 4), (3, 5, 4)),  # batches that differ
    ((5, 3), (2, 4), (5, 4)),  # contraction sizes that differ
])
def test_products_one_call_cannot_express_are_declined(a_shape, b_shape, out_shape):
    assert cublas.plan(a_shape, b_shape, out_shape, False, False) is None


def _read(pointer, count):
    return np.ctypeslib.as_array((ctypes.c_float * count).from_address(pointer)).copy()


def test_matmul_passes_the_tensors_pointers_in_cupys_argument_order(monkeypatch):
    """CuPy 14.2's binding (read from its module): gemmStridedBatchedEx(handle, transa, transb,
    m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc,
    strideC, batchCount, computeType, algo), alpha and beta host pointers."""
    calls = []

    def gemm(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb,
             strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
        calls.append((handle, Atype, Btype, Ctype, computeType, algo))
        assert _read(alpha, 1)[0] == 1 and _read(beta, 1)[0] == 0
        p = cublas.GemmPlan(transa, transb, m, n, k, lda, ldb, ldc, strideA, strideB, strideC,
                            batchCount)
        first = _read(A, (batchCount - 1) * strideA + m * k if strideA else m * k)
        second = _read(B, (batchCount - 1) * strideB + k * n if strideB else k * n)
        c = np.zeros(batchCount * m * n)
        _gemm_strided_batched(p, first.astype(np.float64), second.astype(np.float64), c)
        ctypes.memmove(C, c.astype(np.float32).ctypes.data, c.size * 4)

    monkeypatch.setattr(cublas, "_library", [(gemm, lambda: 77, RuntimeError)])
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 6, 5, 3)).astype(np.float32)
    b = rng.standard_normal((2, 6, 4, 3)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((2, 6, 5, 4), np.float32))
    assert cublas.matmul(tvm.runtime.tensor(a), tvm.runtime.tensor(b), False, True, out)
    np.testing.assert_allclose(out.numpy(), a @ np.swapaxes(b, -1, -2), rtol=1e-5, atol=1e-5)
    assert calls == [(77, 0, 0, 0, cublas.COMPUTE_32F, cublas.GEMM_DEFAULT)]


def test_a_product_beyond_cublas_int_arguments_is_declined():
    assert cublas.plan((2**20, 2**12, 3), (3, 4), (2**20, 2**12, 4), False, False) is None


def test_a_cublas_error_falls_back(monkeypatch):
    class Declined(Exception):
        pass

    def gemm(*args):
        raise Declined("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(cublas, "_library", [(gemm, lambda: 1, Declined)])
    f = tvm.runtime.tensor(np.ones((2, 2), np.float32))
    assert not cublas.matmul(f, f, False, False, f)


def test_other_dtypes_and_a_missing_binding_fall_back(monkeypatch):
    a = tvm.runtime.tensor(np.ones((2, 2), np.float64))
    assert not cublas.matmul(a, a, False, False, tvm.runtime.tensor(np.ones((2, 2))))
    monkeypatch.setattr(cublas, "_library", [None])  # no CuPy: blas runs its own path
    f = tvm.runtime.tensor(np.ones((2, 2), np.float32))
    assert not cublas.matmul(f, f, False, False, f)
