"""Build and install raf_dist: the Python package plus the native collective runtime.

`pip install -e .` (what `make install` runs) configures CMake with config.cmake for the
Python that runs this script and puts libraf_dist.so next to python/raf_dist/__init__.py.
USE_MPI / USE_CUDA / USE_NCCL in the environment override config.cmake.
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Runs CMake instead of compiling sources itself."""

    def get_ext_filename(self, ext_name):
        return os.path.join(*ext_name.split(".")[:-1], "libraf_dist.so")

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = ROOT / "build"
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={target.parent}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        args += [f"-D{k}={os.environ[k]}" for k in ("USE_MPI", "USE_CUDA", "USE_NCCL") if k in os.environ]
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args])
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)])


setup(
    name="raf_dist",
    version="0.1.0",
    description="Compiler-pass distributed training (data parallel, ZeRO-1/2/3) on Apache TVM Relax",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("raf_dist.libraf_dist")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=[
        "apache-tvm==0.27.0.post1",
        "apache-tvm-ffi==0.1.15.post2",
        "numpy>=1.26",
        "mpi4py>=4.0",
        "ml-dtypes",
        "threadpoolctl",
        "safetensors",
    ],
    extras_require={
        "torch": ["torch==2.13.0"],
        # transformers / torchvision: third-party models for the tests only (raf_dist never
        # imports them); torchvision 0.28.0 is the release built against torch 2.13.0
        # mypy / import-linter: `make typecheck` and the layer contracts of pyproject.toml
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist==3.8.0", "scikit-learn", "safetensors", "tqdm", "matplotlib",
                 "transformers==5.23.0", "torchvision==0.28.0", "mypy==2.4.1",
                 "import-linter==2.16"],
        "cuda12": ["cupy-cuda12x>=13", "nvidia-nccl-cu12>=2.18", "nvidia-ml-py"],
        "cuda13": ["cupy-cuda13x>=13", "nvidia-nccl-cu13>=2.18", "nvidia-ml-py"],
    },
    entry_points={"console_scripts": ["raf_dist-run = raf_dist.run:main"]},
    zip_safe=False,
)
