"""Where a rank computes: the CPU, or one CUDA GPU per rank.

``Trainer(..., device="cuda")`` puts parameters, activations and the compiled step on
``cuda(local_rank)`` (``"cuda:N"`` picks GPU N of the host explicitly); the default stays
``"cpu"``. Before anything runs on a GPU the ranks of a data-parallel job check, together,
that the GPU exists, that TVM can compile CUDA kernels here (``cuda_compiler``), that the
native runtime was built with NCCL (collectives and buckets on GPU memory need it), and that
no two ranks share a GPU (pynvml's device UUIDs; without pynvml, the host and the index) —
each failure is a ValueError naming the rank, host and fix, raised before any collective on
GPU memory. ``memory_stats`` reads the GPU's used / total memory with pynvml
for ``Trainer.stats()``.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from typing import Any, Protocol, Sequence

import tvm

from . import _native

ACCEPTED = '"cpu", "cuda" (the GPU of this rank\'s local rank) or "cuda:N"'


class RankPlace(Protocol):
    """What ``select`` reads of a ``raf_dist.distributed.Communicator`` (a protocol: this
    layer sits below ``distributed`` and does not import it)."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def hosts(self) -> Sequence[str]: ...
    @property
    def mpi_comm(self) -> Any: ...  # an mpi4py communicator


def parse(device: str) -> tuple[str, int | None]:
    """("cpu", None) or ("cuda", index or None) from the ``device`` argument."""
    if device == "cpu":
        return "cpu", None
    if device == "cuda":
        return "cuda", None
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", int(device[5:])
    raise ValueError(f"device {device!r} is not one of {ACCEPTED}")


@functools.lru_cache(maxsize=None)
def _nvml() -> Any:
    """pynvml, initialised once, or None (no pynvml or no driver)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no pynvml, or no driver: identity falls back
        return None


def _physical_index(index: int) -> str:
    """The host-wide index of visible GPU ``index`` (CUDA_VISIBLE_DEVICES applied)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return str(index)
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    return entries[index] if index < len(entries) else str(index)


def _nvml_handle(nvml: Any, physical: str) -> Any:
    """pynvml's handle of a GPU named by host-wide index or UUID (CUDA_VISIBLE_DEVICES)."""
    if physical.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(physical))
    return nvml.nvmlDeviceGetHandleByUUID(physical)


def gpu_identity(host: str, index: int) -> str:
    """A name of the physical GPU that is equal for two ranks exactly when they share it."""
    nvml = _nvml()
    physical = _physical_index(index)
    if nvml is not None:
        try:
            uuid = nvml.nvmlDeviceGetUUID(_nvml_handle(nvml, physical))
            return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        except Exception:  # noqa: BLE001
            pass
    return f"{host}:gpu{physical}"


def check_one_rank_per_gpu(identities: Sequence[str], hosts: Sequence[str]) -> None:
    """Raise naming the ranks that would share a GPU (``identities[r]`` is rank r's GPU)."""
    owners: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        owners.setdefault(identity, []).append(rank)
    shared = {k: v for k, v in owners.items() if len(v) > 1}
    if shared:
        identity, ranks = next(iter(shared.items()))
        raise ValueError(
            f"ranks {ranks} on {hosts[ranks[0]]} would share one GPU ({identity}): raf_dist runs "
            "one rank per GPU (NCCL needs it). Start at most as many ranks per host as it has "
            "GPUs, or give each rank its own with device='cuda:N' / CUDA_VISIBLE_DEVICES")


def cuda_compiler() -> str | None:
    """How TVM will compile the step's CUDA kernels on this host: ``$TVM_CUDA_COMPILE_MODE``
    when set; else TVM's default, NVRTC, when the cuda-bindings package it needs is
    installed; else nvcc when it is on PATH; None when neither is there. Both read the CUDA
    toolkit's headers (nvcc on PATH, ``CUDA_PATH`` or /usr/local/cuda). The apache-tvm
    wheel defaults to NVRTC without depending on cuda-bindings, so on a host with only nvcc
    a CUDA build would fail at its first kernel; ``compiler.build`` applies this choice."""
    mode = os.environ.get("TVM_CUDA_COMPILE_MODE")
    if mode:
        return mode.lower()
    try:
        has_bindings = importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:  # no "cuda" namespace package at all
        has_bindings = False
    if has_bindings:
        return "nvrtc"
    return "nvcc" if shutil.which("nvcc") else None


def select(device: str, comm: RankPlace, collective: bool = True) -> tvm.runtime.Device:
    """The tvm Device for this rank. For a GPU with ``collective`` (a data-parallel job of
    several ranks: every rank must call it) the ranks agree first that every one has its GPU
    and an NCCL build, and that no two share a GPU; otherwise (a Trainer of this rank alone,
    which other ranks may not build) only this rank's GPU is checked, with no collective."""
    kind, index = parse(device)
    if kind == "cpu":
        return tvm.cpu()
    index = comm.local_rank if index is None else index
    problem = None
    if not tvm.cuda(index).exist:
        count = sum(1 for i in range(64) if tvm.cuda(i).exist)
        problem = (f"rank {comm.rank} on {comm.host} asked for cuda:{index} but TVM sees "
                   f"{count} CUDA GPU(s) there" + ("" if count else
                                                    " (no NVIDIA driver or GPU on this host)")
                   + ("; start at most that many ranks per host" if count else
                      "; use device='cpu'"))
    elif cuda_compiler() is None:
        problem = (f"rank {comm.rank} on {comm.host}: compiling the step for CUDA needs the "
                   "CUDA toolkit's nvcc on PATH (or the cuda-bindings package, for NVRTC); "
                   "install the CUDA toolkit or add its bin/ to PATH")
    elif not _native.func("nccl_enabled")():
        problem = ("raf_dist's native runtime was built without NCCL, which GPU collectives and "
                   "gradient buckets need: reinstall with USE_CUDA=ON USE_NCCL=ON "
                   "(pip install -e .[cuda12] or .[cuda13] provides NCCL)")
    collective = collective and comm.size > 1
    problems = comm.mpi_comm.allgather(problem) if collective else [problem]
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if failed:
        raise ValueError("; ".join(p for _, p in failed))
    if collective:
        check_one_rank_per_gpu(comm.mpi_comm.allgather(gpu_identity(comm.host, index)),
                               comm.hosts)
    return tvm.cuda(index)


def is_gpu(dev: tvm.runtime.Device) -> bool:
    """Whether ``dev`` is a CUDA GPU (else this host's CPU)."""
    return dev.dlpack_device_type() == tvm.cuda(0).dlpack_device_type()


def memory_stats(dev: tvm.runtime.Device) -> dict[str, int]:
    """{"device_memory_used_bytes", "device_memory_total_bytes"} of a GPU (pynvml), or {}
    on the CPU or without pynvml."""
    if not is_gpu(dev):
        return {}
    nvml = _nvml()
    if nvml is None:
        return {}
    info = nvml.nvmlDeviceGetMemoryInfo(_nvml_handle(nvml, _physical_index(dev.index)))
    return {"device_memory_used_bytes": int(info.used),
            "device_memory_total_bytes": int(info.total)}


def target_for(dev: tvm.runtime.Device) -> str | tvm.target.Target:
    """The compile target of a device: "cuda" for a GPU, else this host's CPU (host_target)."""
    return "cuda" if is_gpu(dev) else host_target()


def host_target() -> str | tvm.target.Target:
    """LLVM for the CPU this process runs on. Plain "llvm" means generic x86-64 (SSE2, no FMA):
    LLVM then leaves most of a step's elementwise loops scalar — measured here (znver3), an exp
    over 1M floats took 2.6 ms generic and 0.46 ms with the host's AVX2/FMA. The build cache
    key holds the target, so hosts with different CPUs never share a compiled step."""
    cpu = tvm.get_global_func("target.llvm_get_system_cpu", allow_missing=True)
    name = cpu() if cpu is not None else ""
    if not name or name == "generic":
        return "llvm"
    return tvm.target.Target({"kind": "llvm", "mcpu": name})


@functools.lru_cache(maxsize=None)
def cpu_info(field: str) -> str:
    """The value of ``field`` ("model name", "flags") on the first line of /proc/cpuinfo that
    has it; "" where there is none (another OS). Read once per field."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
