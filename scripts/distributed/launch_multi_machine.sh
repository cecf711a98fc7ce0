#!/usr/bin/env bash
# Run a raf_dist script across the hosts of a hostfile (MPICH format: "host:slots" per line;
# Open MPI: "host slots=N"). Every host needs this checkout at the same path with its .venv
# (run `make install` on each) and passwordless ssh from this one.
#   scripts/distributed/launch_multi_machine.sh hosts.txt 8 scripts/distributed/dist_example.py
set -euo pipefail
cd "$(dirname "$0")/../.."
hostfile="${1:?usage: $0 HOSTFILE NUM_RANKS SCRIPT [ARGS...]}"; np="${2:?}"; shift 2
venv="${VENV:-.venv}"
mpirun="$venv/bin/mpirun"; [ -x "$mpirun" ] || mpirun=mpirun
exec "$mpirun" --hostfile "$hostfile" -np "$np" "$venv/bin/python" "$@"
