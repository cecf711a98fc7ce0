"""Device selection without a GPU: accepted device strings, the one-rank-per-GPU rule, the
GPU identity under CUDA_VISIBLE_DEVICES, and the clear error for device='cuda' on a host
without one."""
import pytest
import tvm

import raf_dist
from models import make, raf_optimizer
from raf_dist import device


@pytest.mark.parametrize("text, parsed", [("cpu", ("cpu", None)), ("cuda", ("cuda", None)),
                                          ("cuda:3", ("cuda", 3))])
def test_accepted_devices(text, parsed):
    assert device.parse(text) == parsed


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "CUDA", "", None, "cuda:"])
def test_other_devices_are_refused_naming_the_accepted_ones(text):
    with pytest.raises(ValueError, match='"cpu", "cuda"'):
        device.parse(text)


def test_two_ranks_on_one_gpu_are_refused_naming_them():
    device.check_one_rank_per_gpu(["GPU-a", "GPU-b", "GPU-c"], ["h0", "h0", "h1"])  # fine
    with pytest.raises(ValueError, match=r"ranks \[0, 2\] on h0 would share one GPU \(GPU-a\)"):
        device.check_one_rank_per_gpu(["GPU-a", "GPU-b", "GPU-a"], ["h0", "h0", "h0"])


def test_gpu_identity_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(device, "_nvml", lambda: None)  # no pynvml: host and physical index
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert device.gpu_identity("h0", 1) == "h0:gpu3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device.gpu_identity("h0", 1) == "h0:gpu1"
    # ranks of one host that see different GPUs through CUDA_VISIBLE_DEVICES are fine
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    first = device.gpu_identity("h0", 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    device.check_one_rank_per_gpu([first, device.gpu_identity("h0", 0)], ["h0", "h0"])


def test_cpu_device_needs_no_gpu_stack():
    assert device.target_for(tvm.cpu()) == "llvm"
    assert device.memory_stats(tvm.cpu()) == {}


@pytest.mark.skipif(tvm.cuda(0).exist, reason="this host has a GPU")
def test_cuda_trainer_without_a_gpu_says_so_before_compiling():
    module, x, _ = make("mlp", 4)
    with pytest.raises(ValueError, match=r"asked for cuda:0 but TVM sees 0 CUDA GPU\(s\) there "
                                         r"\(no NVIDIA driver or GPU on this host\); use device='cpu'"):
        raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                         optimizer=raf_optimizer("adamw"), device="cuda")
