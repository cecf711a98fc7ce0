"""GPU tier (skipped without an NVIDIA GPU, CuPy and a native runtime built with NCCL — run
scripts/gpu_check.sh on a GPU machine): the same training steps on cuda(0) as on the CPU,
with matmul on cuBLAS by one direct call and convolution through CuPy, and a single-rank
NCCL run (ZeRO-2 in a world of one: reduce_scatter, allgather, local_shard and buckets on GPU
memory; alltoall), and bf16 mixed precision on the GPU."""
import pytest
import tvm

import raf_dist
from models import make, raf_optimizer, rel_err, torch_reference, train_zero
from raf_dist import _native


def _gpu_ready():
    if not tvm.cuda(0).exist:
        return "no CUDA GPU"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "no CuPy (pip install -e .[cuda12] or .[cuda13])"
    if not _native.func("nccl_enabled")():
        return "native runtime built without NCCL (USE_CUDA=ON USE_NCCL=ON)"
    return None


pytestmark = pytest.mark.skipif(_gpu_ready() is not None, reason=str(_gpu_ready()))


def _train(name, device, level=0, steps=3):
    losses, trainer, _ = train_zero(name, 8, level, steps, device)
    return losses, trainer.state_dict(), trainer


def _close(gpu, cpu):
    """GPU and CPU runs agree as the distributed tests require of DP against one process
    (norm-relative, 2e-5): both are float32 with different summation orders; CuPy leaves
    TF32 off unless CUPY_TF32=1, which would break this comparison."""
    losses, params, _ = gpu
    ref_losses, ref_params, _ = cpu
    assert rel_err(losses, ref_losses) <= 2e-5, (losses, ref_losses)
    assert params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        assert rel_err(params[key], value) <= 2e-5, (key, rel_err(params[key], value))


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_gpu_step_matches_cpu(name):
    gpu = _train(name, "cuda")
    _close(gpu, _train(name, "cpu"))
    stats = gpu[2].stats()
    if "device_memory_total_bytes" in stats:  # pynvml present
        assert 0 < stats["device_memory_used_bytes"] <= stats["device_memory_total_bytes"]


def test_single_rank_nccl_zero2_matches_cpu():
    _close(_train("mlp", "cuda", level=2), _train("mlp", "cpu"))


def test_single_rank_nccl_alltoall():
    """The alltoall kind on GPU memory through NCCL (grouped send/recv), equal blocks and
    per-rank counts, in a world of one (the exchange is a copy to itself)."""
    import cupy
    import numpy as np
    import tvm_ffi

    from raf_dist import distributed as dist

    group, t = dist.get_communicator().group, tvm_ffi.from_dlpack
    x = cupy.arange(6, dtype=cupy.float32)
    out, out_v = cupy.zeros_like(x), cupy.zeros_like(x)
    _native.func("alltoall")(t(x), group, t(out))
    splits = np.array([6], np.int64)
    _native.func("alltoall")(t(x), t(splits), t(splits), group, t(out_v))
    assert cupy.array_equal(out, x) and cupy.array_equal(out_v, x)
    assert dist.comm_counters()["alltoall"]["calls"] >= 2


def test_predict_on_gpu():
    _, _, trainer = _train("mlp", "cuda", steps=1)
    module, x, _ = make("mlp", 8)
    assert trainer.predict(x.numpy()).shape == (8, 5)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_bf16_on_gpu_as_close_to_fp32_as_torch_autocast(name):
    """Trainer(precision="bf16") on cuda(0), held to the bar tests/numeric/test_mixed_precision.py
    holds the CPU run to: as close to PyTorch's float32 run as PyTorch's own bf16 autocast is,
    within the same factor (3.0; the calibration is explained there)."""
    import torch

    module, x, y = make(name, 8)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_optimizer("adamw"), precision="bf16", device="cuda")
    losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(5)]
    params = trainer.state_dict()
    fp32_losses, fp32_params = torch_reference(name, "adamw", 8, 5)
    amp_losses, amp_params = torch_reference(name, "adamw", 8, 5, autocast=torch.bfloat16)

    def distance(run_losses, run_params):
        return max([rel_err(run_losses, fp32_losses)]
                   + [rel_err(run_params[k], fp32_params[k]) for k in fp32_params])

    ours, theirs = distance(losses, params), distance(amp_losses, amp_params)
    print(f"{name} on GPU: raf_dist bf16 {ours:.2e}, torch autocast {theirs:.2e} from float32")
    assert 0 < ours <= 3.0 * theirs, (ours, theirs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("a_shape, b_shape, trans_a, trans_b", [
    ((64, 48), (48, 32), False, False), ((48, 64), (32, 48), True, True),
    ((2, 4, 16, 8), (2, 4, 16, 8), False, True),  # the attention's scores
    ((2, 16, 48), (48, 32), False, False),  # activations x weight: the batch folded
    ((2, 48, 16), (48, 32), True, False),  # a weight gradient's transposed activations
])
def test_direct_cublas_matmul_equals_numpy(a_shape, b_shape, trans_a, trans_b, dtype):
    """raf_dist.blas.matmul on GPU tensors takes the direct cuBLAS call (runtime/cublas.py,
    its argument mapping checked without a GPU in tests/unit/test_cublas_plan.py) and gives
    numpy's float64 product within float32's (or bf16's, rounded once) error."""
    import ml_dtypes
    import numpy as np
    from raf_dist.runtime import blas, cublas

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
    host = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    a, b = a.astype(host), b.astype(host)
    expected = np.matmul(np.swapaxes(a, -1, -2) if trans_a else a,
                         np.swapaxes(b, -1, -2) if trans_b else b, dtype=np.float64)
    dev = tvm.cuda(0)
    ta, tb = tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)
    out = tvm.runtime.tensor(np.zeros(expected.shape, host), dev)
    assert cublas.plan(tuple(a.shape), tuple(b.shape), expected.shape, trans_a, trans_b)
    blas.matmul(ta, tb, trans_a, trans_b, out)
    dev.sync()
    tol = 1e-5 if dtype == "float32" else 2 ** -8  # bf16: the product rounded once
    got = out.numpy().astype(np.float64)
    assert np.abs(got - expected).max() <= tol * np.abs(expected).max() * 4
