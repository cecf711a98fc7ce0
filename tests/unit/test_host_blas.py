"""Host BLAS on TVM's thread pool (runtime/openblas.py, src/blas/batched_gemm.cc): TVM's pool
really has the threads set_num_threads asks for, numpy's OpenBLAS runs its parallel jobs there,
and a batch of small products spread over the pool equals numpy's matmul in every layout."""
import os

import numpy as np
import pytest
import tvm
import tvm_ffi

from raf_dist.runtime import available_cores, blas, openblas, set_num_threads

needs_two_cores = pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores")


@pytest.fixture(scope="module")
def two_threads():
    set_num_threads(2)
    if not openblas.can_share_pool():
        pytest.skip("numpy's BLAS is not an OpenBLAS with a threads callback")
    return openblas._native_funcs()


@needs_two_cores
def test_tvm_pool_runs_two_tasks_at_once(two_threads):
    # config_threadpool alone left TVM_NUM_THREADS unset: one worker, every kernel on one thread
    assert tvm.get_global_func("runtime.NumThreads")() == 2
    assert two_threads["pool_tasks"](2) == 2


@needs_two_cores
def test_openblas_runs_its_jobs_on_the_tvm_pool(two_threads):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = rng.standard_normal((256, 384)).astype(np.float32)
    before = two_threads["openblas_pool_launches"]()
    out = a @ b  # 50M multiply-adds: OpenBLAS splits it over its threads
    assert two_threads["openblas_pool_launches"]() > before
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)


# (a's shape, b's shape, transpose a, transpose b): the attention's products, a broadcast
# weight, two batch axes, and every transpose combination
LAYOUTS = [
    ((64, 64, 64), (64, 64, 32), False, False),
    ((64, 64, 32), (64, 64, 32), False, True),
    ((64, 64, 64), (64, 64, 32), True, False),
    ((64, 64, 64), (64, 32, 64), True, True),
    ((4, 16, 64, 32), (32, 48), False, False),
    ((16, 4, 64, 32), (16, 4, 32, 64), False, False),
    ((8, 4, 32), (8, 16, 32), False, True),  # A B^T with few rows: no copy of B^T
]


@needs_two_cores
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape_a,shape_b,trans_a,trans_b", LAYOUTS)
def test_batched_products_equal_numpy(two_threads, shape_a, shape_b, trans_a, trans_b, dtype):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(shape_a).astype(dtype)
    b = rng.standard_normal(shape_b).astype(dtype)
    a_view = a.swapaxes(-1, -2) if trans_a else a
    b_view = b.swapaxes(-1, -2) if trans_b else b
    expected = np.matmul(a_view.astype(np.float64), b_view.astype(np.float64))
    out = np.full(expected.shape, np.nan, dtype)
    assert openblas.batched_matmul(a_view, b_view, out), "the batched path refused the layout"
    np.testing.assert_allclose(out, expected, rtol=1e-4 if dtype == "float32" else 1e-12,
                               atol=1e-4 if dtype == "float32" else 1e-12)
    # and through raf_dist.blas.matmul as a compiled step calls it
    out[...] = np.nan
    blas.matmul(*(tvm_ffi.from_dlpack(x) for x in (a, b)), trans_a, trans_b,
                tvm_ffi.from_dlpack(out))
    np.testing.assert_allclose(out, expected, rtol=1e-4 if dtype == "float32" else 1e-12,
                               atol=1e-4 if dtype == "float32" else 1e-12)


@needs_two_cores
def test_layouts_the_batched_path_refuses_go_to_numpy(two_threads):
    rng = np.random.default_rng(2)
    # batch axes no single stride walks: a broadcast against a broadcast, a transposed batch
    a = rng.standard_normal((3, 1, 20, 8)).astype(np.float32)
    b = rng.standard_normal((5, 8, 12)).astype(np.float32)
    out = np.full((3, 5, 20, 12), np.nan, np.float32)
    assert not openblas.batched_matmul(a, b, out)
    blas.matmul(tvm_ffi.from_dlpack(a), tvm_ffi.from_dlpack(b), False, False,
                tvm_ffi.from_dlpack(out))
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)
    swapped = rng.standard_normal((4, 8, 16, 16)).astype(np.float32).transpose(1, 0, 2, 3)
    assert not openblas.batched_matmul(swapped, swapped, np.empty((8, 4, 16, 16), np.float32))
    # a product big enough for OpenBLAS's own split (more than 65536 x 4 multiply-adds)
    big = rng.standard_normal((2, 128, 128)).astype(np.float32)
    assert not openblas.batched_matmul(big, big, np.empty((2, 128, 128), np.float32))


@needs_two_cores
def test_blas_in_a_forked_child_does_not_wait_for_the_parents_pool(two_threads):
    import os
    import signal
    import time

    a = np.full((512, 512), 0.5, np.float32)
    small = np.full((8, 32, 32), 0.5, np.float32)
    a @ a  # the parent's pool has run OpenBLAS's jobs
    pid = os.fork()
    if pid == 0:  # a data-loader worker: none of TVM's workers came along
        try:
            out = np.empty((8, 32, 32), np.float32)
            ok = np.allclose(a @ a, 128.0) and openblas.batched_matmul(small, small, out) \
                and np.allclose(out, 8.0)
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("a BLAS call in a forked child hung (it waited for TVM's workers)")


@needs_two_cores
def test_rows_longer_than_the_matrix(two_threads):
    # slices of wider rows: leading dimensions larger than the matrices' widths
    rng = np.random.default_rng(3)
    a = rng.standard_normal((8, 16, 64)).astype(np.float32)[:, :, 8:40]
    b = rng.standard_normal((8, 48, 24)).astype(np.float32)[:, 4:36, :20]
    out = np.empty((8, 16, 20), np.float32)
    assert openblas.batched_matmul(a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


@needs_two_cores
def test_blas_from_another_thread_while_the_owner_computes(two_threads):
    """TVM's pools are per thread: BLAS from a thread other than the one set_num_threads ran
    on must neither launch on the owner's pool nor wait for it, and both results are right."""
    import threading

    rng = np.random.default_rng(4)
    a = rng.standard_normal((384, 384)).astype(np.float32)
    small = rng.standard_normal((16, 32, 32)).astype(np.float32)
    expected, expected_small = a.astype(np.float64) @ a, small.astype(np.float64) @ small
    results = {}

    def other():
        out = np.empty_like(small)
        results["other"] = [np.allclose(a @ a, expected, rtol=1e-4, atol=1e-2)
                            for _ in range(20)]
        results["other_small"] = openblas.batched_matmul(small, small, out) and \
            np.allclose(out, expected_small, rtol=1e-4, atol=1e-4)

    thread = threading.Thread(target=other)
    thread.start()
    mine = [np.allclose(a @ a, expected, rtol=1e-4, atol=1e-2) for _ in range(20)]
    thread.join(timeout=120)
    assert not thread.is_alive(), "a BLAS call from a second thread hung"
    assert all(mine) and all(results["other"]) and results["other_small"]


@needs_two_cores
def test_openblas_jobs_complete_when_tvm_runs_fewer_tasks(two_threads, monkeypatch):
    # with TVM_NUM_THREADS=1 TVM's launch runs task 0 only; OpenBLAS's jobs wait on each other,
    # so the missing ones must run beside it (they hung otherwise)
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    rng = np.random.default_rng(5)
    a = rng.standard_normal((512, 512)).astype(np.float32)
    np.testing.assert_allclose(a @ a, a.astype(np.float64) @ a, rtol=1e-4, atol=1e-2)


def test_small_16_bit_products_run_on_one_thread(two_threads, monkeypatch):
    """A bf16 product below the threshold runs on the calling thread alone (waking PyTorch's
    sleeping OpenMP team costs more than it saves there), above it on the team; both equal
    the float32 product of the same operands within bf16's rounding of the output and leave
    the team's size as it was. RAF_DIST_ONE_THREAD_GEMM_MFLOP sets the threshold."""
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("RAF_DIST_LOW_GEMM", "native")
    monkeypatch.setattr(blas, "_modes", {})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_small_products(torch, monkeypatch)
    finally:
        torch.set_num_threads(before)


def _check_small_products(torch, monkeypatch):
    import ml_dtypes

    assert blas._one_thread_below() == blas.ONE_THREAD_GEMM_FLOPS
    seen = []
    real_matmul = torch.matmul

    def matmul(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_matmul(*args, **kwargs)

    monkeypatch.setattr(torch, "matmul", matmul)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((48, 32)).astype(ml_dtypes.bfloat16)
    out = tvm.runtime.tensor(np.zeros((64, 48), ml_dtypes.bfloat16))
    for mflop, threads in (("1e9", 1), ("0", 2)):
        monkeypatch.setenv("RAF_DIST_ONE_THREAD_GEMM_MFLOP", mflop)
        blas.matmul(tvm.runtime.tensor(a), tvm.runtime.tensor(b), False, True, out)
        assert seen[-1] == threads and torch.get_num_threads() == 2
        expected = a.astype(np.float32) @ b.astype(np.float32).T
        np.testing.assert_allclose(out.numpy().astype(np.float32), expected,
                                   rtol=2 ** -7, atol=2 ** -7 * np.abs(expected).max())


@pytest.mark.parametrize("user_value", [None, "7"])
def test_a_second_pool_makes_tvm_workers_spin_briefly(two_threads, monkeypatch, user_value):
    """With a second pool on the cores (a 16-bit step's GEMMs on PyTorch's OpenMP team),
    set_num_threads asks TVM's idle workers for SECOND_POOL_SPIN_COUNT yielding rounds (not 0,
    not TVM's 300000: the measurement is in runtime/threads.py) through the variable TVM reads
    when its pool first runs; a count the user set wins."""
    from raf_dist.runtime import threads

    monkeypatch.setenv("TVM_THREAD_POOL_SPIN_COUNT", "placeholder")  # restored afterwards
    monkeypatch.delenv("TVM_THREAD_POOL_SPIN_COUNT")
    if user_value is not None:
        monkeypatch.setenv("TVM_THREAD_POOL_SPIN_COUNT", user_value)
    set_num_threads(2, second_pool=True)
    expected = user_value or str(threads.SECOND_POOL_SPIN_COUNT)
    assert expected != "0" and threads.SECOND_POOL_SPIN_COUNT < 300000
    assert tvm.get_global_func("runtime.NumThreads")() == 2
    assert os.environ["TVM_THREAD_POOL_SPIN_COUNT"] == expected
