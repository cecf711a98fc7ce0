"""Run a script under the MPI launcher with a hard timeout (every multi-process test uses this).

The launcher runs in a process session of its own; on timeout that session — the launcher and
the ranks it started, nothing else — is killed and the test fails with the output so far.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "distributed" / "workers"


def mpiexec():
    venv_launcher = Path(sys.executable).parent / "mpiexec"
    return str(venv_launcher) if venv_launcher.exists() else "mpiexec"


def launcher_is_open_mpi():
    """Open MPI and MPICH take different hostfile formats (and Open MPI more flags)."""
    out = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=30)
    # Open MPI 5 says "Open MPI"; 4.x says "mpiexec (OpenRTE) 4.1.6" and points to open-mpi.org
    text = (out.stdout + out.stderr).lower()
    return any(mark in text for mark in ("open mpi", "openrte", "open-mpi"))


def localhost_hostfile():
    name = "hostfile.openmpi.localhost" if launcher_is_open_mpi() else "hostfile.localhost"
    return ROOT / "scripts" / "distributed" / name


def run_mpi(script, nprocs, *args, timeout=180, launcher_args=(), env=None):
    """Run ``python script *args`` on ``nprocs`` ranks; returns (returncode, output, seconds)."""
    import time

    script = Path(script)
    if not script.is_absolute():
        script = WORKERS / script
    cmd = [mpiexec(), *launcher_args, "-n", str(nprocs), sys.executable, str(script), *map(str, args)]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started: launcher + its ranks
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout} s:\n{out}")
    return proc.returncode, out, time.monotonic() - start


def check_mpi(script, nprocs, *args, **kwargs):
    """run_mpi that asserts success and returns the output."""
    code, out, _ = run_mpi(script, nprocs, *args, **kwargs)
    assert code == 0, f"{script} on {nprocs} ranks exited {code}:\n{out}"
    return out
