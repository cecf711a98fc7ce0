#!/usr/bin/env bash
# The GPU checks in one command, for a machine with one or more NVIDIA GPUs, the CUDA toolkit
# (nvcc) and access to the package registry: builds raf_dist with USE_CUDA=ON USE_NCCL=ON in a
# venv of its own (./.venv is untouched), then runs the GPU tier (GPU vs CPU results, a
# single-rank NCCL run), the CUDA build tier, the GPU step-time benchmark (raf_dist vs
# PyTorch eager on the same GPU; needs PyTorch's CUDA build, which PyPI's torch is on Linux),
# and, with two or more GPUs, the distributed example on all of them (NCCL between ranks).
#   scripts/gpu_check.sh [WORKDIR]            (default /tmp/raf_dist_gpu)
#   CUDA_EXTRA=cuda12 scripts/gpu_check.sh    (CuPy/NCCL for CUDA 12; default from nvcc)
#   GPU_CHECK_OFFLINE=1 scripts/gpu_check.sh  (a machine without network whose python3 already
#       has PyTorch, CuPy, nvidia-nccl, mpi4py + an MPI and, importable or as wheels in
#       $GPU_CHECK_WHEELS, apache-tvm and apache-tvm-ffi: installs into that python, no venv)
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-/tmp/raf_dist_gpu}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv
major="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
extra="${CUDA_EXTRA:-cuda${major:-12}}"
rm -rf "$work" && mkdir -p "$work"
if [ -d "$src/.git" ]; then
  git clone -q "$src" "$work/src"
else  # a copy of a working tree without git: leave its build outputs behind
  cp -a "$src" "$work/src" && rm -rf "$work/src/build" "$work/src"/python/raf_dist/*.so
fi
if [ "${GPU_CHECK_OFFLINE:-0}" = 1 ]; then
  py=python3
  if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    "$py" -m pip install -q --no-index --no-deps "$GPU_CHECK_WHEELS"/*.whl
  fi
  cd "$work/src"
  # CMake looks for the NCCL wheel in the install's own site-packages; point it at python3's
  # (nvidia/nccl for the cu12 wheels; the cu13 ones may nest it deeper): the folder that holds
  # include/nccl.h, unless NCCL_ROOT is set already
  if [ -z "${NCCL_ROOT:-}" ]; then
    NCCL_ROOT="$("$py" -c "import glob, importlib.util, os
spec = importlib.util.find_spec('nvidia')
roots = list(spec.submodule_search_locations) if spec else []
hits = [h for r in roots for h in glob.glob(os.path.join(r, '**', 'include', 'nccl.h'), recursive=True)]
print(os.path.dirname(os.path.dirname(hits[0])) if hits else '')")"
  fi
  echo "NCCL_ROOT=${NCCL_ROOT:-<none found>}"
  export NCCL_ROOT
  USE_CUDA=ON USE_NCCL=ON "$py" -m pip install -q --no-index --no-build-isolation --no-deps -e .
else
  python3 -m venv "$work/venv"
  py="$work/venv/bin/python"
  "$py" -m pip install -q --upgrade pip
  command -v mpicc >/dev/null 2>&1 || "$py" -m pip install -q mpich
  "$py" -m pip install -q "setuptools>=64" wheel "cmake>=3.18" apache-tvm-ffi==0.1.15.post2 torch==2.13.0
  cd "$work/src"
  # pip builds the package before it installs its dependencies, so the NCCL wheel the CUDA
  # build links is not there yet on the first install: install with the extras first, then
  # rebuild
  "$py" -m pip install -q --no-build-isolation -e ".[test,$extra]"
  USE_CUDA=ON USE_NCCL=ON "$py" -m pip install -q --no-build-isolation --no-deps --force-reinstall -e .
fi
# Open MPI refuses to start ranks as root unless told (the lent GPU machines run as root)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$py" - <<'PY'
import tvm, raf_dist
from raf_dist import _native
assert tvm.cuda(0).exist, "TVM sees no CUDA GPU"
assert _native.func("nccl_enabled")(), "the native runtime was built without NCCL"
print("GPU:", tvm.cuda(0).device_name, "compute", tvm.cuda(0).compute_version)
from raf_dist.device import cuda_compiler
assert cuda_compiler(), "no CUDA kernel compiler: put nvcc on PATH or pip install cuda-bindings"
print("CUDA kernels compiled with", cuda_compiler())
PY
# Each stage runs even when one before it failed (a GPU session is short: one failure should
# not hide the others' results); the script fails at the end if any stage did.
failed=()
stage() { echo "=== $1"; shift; "$@" || failed+=("$*"); }
stage "GPU tier: GPU vs CPU results, single-rank NCCL" \
  "$py" -m pytest -q -rs --durations=0 -p no:cacheprovider tests/gpu tests/unit/test_device.py
stage "GPU step time: raf_dist vs PyTorch eager" \
  "$py" bench/step_time.py --device cuda --steps 20 --rounds 3
stage "CUDA build tier" "$py" -m pytest -q -rs -p no:cacheprovider tests/passes/test_cuda_build.py
# every GPU of the machine, one rank each: data parallelism with NCCL collectives between ranks
ngpu="$("$py" -c 'import tvm; print(sum(tvm.cuda(i).exist for i in range(64)))')"
if [ "$ngpu" -ge 2 ]; then
  launcher="$(dirname "$py")/mpiexec"  # the mpich wheel's, else the system MPI's
  [ -x "$launcher" ] || launcher=mpiexec
  stage "distributed example on $ngpu GPUs" timeout 600 "$launcher" -n "$ngpu" "$py" \
    scripts/distributed/dist_example.py --device cuda --epochs 2 --global-batch $((16 * ngpu))
fi
if [ "${#failed[@]}" -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu_check: all stages passed"
