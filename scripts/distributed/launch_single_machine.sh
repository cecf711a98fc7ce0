#!/usr/bin/env bash
# Run a raf_dist script on N ranks of this machine.
#   scripts/distributed/launch_single_machine.sh 4 scripts/distributed/dist_example.py --epochs 3
set -euo pipefail
cd "$(dirname "$0")/../.."
np="${1:?usage: $0 NUM_RANKS SCRIPT [ARGS...]}"; shift
venv="${VENV:-.venv}"
mpirun="$venv/bin/mpirun"; [ -x "$mpirun" ] || mpirun=mpirun
exec "$mpirun" -np "$np" "$venv/bin/python" "$@"
