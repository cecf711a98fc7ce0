"""Run a script under the MPI launcher with a hard timeout (every multi-process test uses this).

The launcher runs in a process session of its own; on timeout that session — the launcher and
the ranks it started, nothing else — is killed and the test fails with the output so far.
assert_ranks_ok checks that every rank printed its "rank R: ALL OK" (or another marker).
"""
import collections
import os
import re
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


def assert_ranks_ok(out, ranks, marker="ALL OK", detail="", prefixed=False, tail=6000):
    """Every rank printed ``rank R: <marker><detail>`` exactly once, and no other rank did.

    ``ranks``: the world size (ranks 0 .. ranks-1) or the exact ranks expected (an iterable).
    ``marker`` is literal text; ``detail``, a regular expression that must follow it on the
    same report (its groups are kept). ``prefixed``: the line came through raf_dist.run's
    output prefix, ``[rank R]: rank R: ...``, the same R twice. Ranks share one stdout, so
    two reports may land on one line: reports are found anywhere, not line by line.
    Returns {rank: match} (group 1 is the rank, ``detail``'s groups follow). On failure the
    message names the ranks missing or repeated and shows the last ``tail`` characters of
    ``out``."""
    expected = list(range(ranks)) if isinstance(ranks, int) else sorted(ranks)
    head = r"\[rank (\d+)\]: rank \1: " if prefixed else r"rank (\d+): "
    matches = list(re.finditer(head + re.escape(marker) + detail, out))
    seen = collections.Counter(int(m.group(1)) for m in matches)
    problems = []
    missing = [r for r in expected if r not in seen]
    if missing:
        problems.append(f"rank(s) {missing} did not print it")
    repeated = sorted(r for r, n in seen.items() if n > 1)
    if repeated:
        problems.append(f"rank(s) {repeated} printed it more than once")
    extra = sorted(set(seen) - set(expected))
    if extra:
        problems.append(f"rank(s) {extra} printed it but only {expected} were expected")
    if problems:
        shown = out if len(out) <= tail else f"[... {len(out) - tail} characters before]\n" \
            + out[-tail:]
        raise AssertionError(f"{marker!r}{' + ' + repr(detail) if detail else ''}: "
                             f"{'; '.join(problems)}. Output:\n{shown}")
    return {int(m.group(1)): m for m in matches}
