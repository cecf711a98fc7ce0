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
    target = tvm.target.Target(device.target_for(tvm.cpu()))
    assert target.kind.name == "llvm"
    assert device.memory_stats(tvm.cpu()) == {}


def test_cpu_target_is_this_hosts_cpu():
    """Compiled for the host's CPU, not generic x86-64 (whose SSE2 leaves loops scalar)."""
    system_cpu = tvm.get_global_func("target.llvm_get_system_cpu")()
    target = tvm.target.Target(device.target_for(tvm.cpu()))
    assert str(target.attrs.get("mcpu", "generic")) == system_cpu


@pytest.mark.skipif(tvm.cuda(0).exist, reason="this host has a GPU")
def test_cuda_trainer_without_a_gpu_says_so_before_compiling():
    module, x, _ = make("mlp", 4)
    with pytest.raises(ValueError, match=r"asked for cuda:0 but TVM sees 0 CUDA GPU\(s\) there "
                                         r"\(no NVIDIA driver or GPU on this host\); use device='cpu'"):
        raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                         optimizer=raf_optimizer("adamw"), device="cuda")


class _TwoRanks:
    """Rank 0 of a two-rank job on this host, recording the collectives it is asked for."""

    def __init__(self):
        self.rank, self.size, self.local_rank, self.host, self.hosts = 0, 2, 0, "h0", ["h0", "h0"]
        self.gathered = []
        self.mpi_comm = self

    def allgather(self, value):
        self.gathered.append(value)
        return [value, "rank 1 on h0 asked for cuda:1 but TVM sees 0 CUDA GPU(s) there"]


@pytest.mark.skipif(tvm.cuda(0).exist, reason="this host has a GPU")
def test_gpu_checks_are_collective_only_for_a_data_parallel_trainer():
    # a Trainer of this rank alone (other ranks may never build one): no collective, so no
    # hang — only this rank's own problem
    comm = _TwoRanks()
    with pytest.raises(ValueError, match="rank 0 on h0 asked for cuda:0") as err:
        device.select("cuda", comm, collective=False)
    assert comm.gathered == [] and "rank 1" not in str(err.value)
    # data parallel: every rank learns every rank's problem, before any GPU collective
    with pytest.raises(ValueError, match="rank 0 on h0 .*; rank 1 on h0 asked for cuda:1"):
        device.select("cuda", comm, collective=True)
    assert len(comm.gathered) == 1


def test_cuda_compiler_follows_the_environment_then_what_is_installed(monkeypatch):
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "NVCC")
    assert device.cuda_compiler() == "nvcc"  # the user's choice wins
    monkeypatch.delenv("TVM_CUDA_COMPILE_MODE")
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: object())
    assert device.cuda_compiler() == "nvrtc"  # TVM's default, when cuda-bindings is there
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(device.shutil, "which", lambda name: "/usr/bin/nvcc")
    assert device.cuda_compiler() == "nvcc"
    monkeypatch.setattr(device.shutil, "which", lambda name: None)
    assert device.cuda_compiler() is None


def test_a_gpu_without_a_cuda_compiler_is_refused_before_anything_runs(monkeypatch):
    class _Gpu:
        exist = True

    monkeypatch.setattr(device.tvm, "cuda", lambda index=0: _Gpu())
    monkeypatch.setattr(device, "cuda_compiler", lambda: None)
    comm = _TwoRanks()
    with pytest.raises(ValueError, match="rank 0 on h0: compiling the step for CUDA needs the "
                                         "CUDA toolkit's nvcc on PATH"):
        device.select("cuda", comm, collective=False)
