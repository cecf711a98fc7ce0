"""GPU tier (skipped without an NVIDIA GPU, CuPy and a native runtime built with NCCL — run
scripts/gpu_check.sh on a GPU machine): the same training steps on cuda(0) as on the CPU,
with matmul/convolution on cuBLAS through CuPy, and a single-rank NCCL run (ZeRO-2 in a
world of one: reduce_scatter, allgather, local_shard and buckets on GPU memory)."""
import pytest
import tvm

from models import make, rel_err, train_zero
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


def test_predict_on_gpu():
    _, _, trainer = _train("mlp", "cuda", steps=1)
    module, x, _ = make("mlp", 8)
    assert trainer.predict(x.numpy()).shape == (8, 5)
