"""config.cmake / cmake/modules: impossible combinations stop the configure step clearly,
and a CPU-only configure succeeds with CUDA/NCCL reported off or found."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("cmake") is None and not
                                (Path(sys.executable).parent / "cmake").exists(),
                                reason="cmake is installed by `make install`")


def configure(tmp_path, *defs):
    cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    return subprocess.run(
        [cmake, "-S", str(ROOT), "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}", *defs],
        capture_output=True, text=True, timeout=120)


def test_nccl_without_cuda_stops_configure(tmp_path):
    result = configure(tmp_path, "-DUSE_CUDA=OFF", "-DUSE_NCCL=ON")
    assert result.returncode != 0
    assert "USE_NCCL=ON requires CUDA" in result.stdout + result.stderr


def test_mpi_off_is_refused(tmp_path):
    result = configure(tmp_path, "-DUSE_MPI=OFF")
    assert result.returncode != 0
    assert "USE_MPI=OFF is not supported" in result.stdout + result.stderr


def test_cpu_only_configure(tmp_path):
    result = configure(tmp_path, "-DUSE_CUDA=OFF", "-DUSE_NCCL=OFF")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "USE_MPI=ON CUDA=OFF NCCL=OFF" in result.stdout
