"""One node's workers for one attempt: start, watch, end.

Each worker runs as ``mpiexec -n 1 python _worker_shim.py ... -- python script args``: a
one-process MPI job (what lets independently started processes connect, see
``distributed/rendezvous.py``), with the shim reporting the worker's real exit status and
process id. Output is prefixed with ``[rank R]:`` line by line, or written to
``LOG_DIR/rankR.log`` (each attempt appended under a header).
"""
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, TextIO

from .config import LaunchError

_SHIM = str(Path(__file__).with_name("_worker_shim.py"))
_OUTPUT_LOCK = threading.Lock()
#: after SIGTERM, how long a worker gets to exit before SIGKILL
TERMINATE_GRACE_SECONDS = 5.0


def mpiexec() -> str:
    """The venv's ``mpiexec`` (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise LaunchError("raf_dist.run starts each worker under `mpiexec -n 1` and found no "
                          "mpiexec: install the mpich wheel (`pip install mpich`) or put MPI's "
                          "bin directory on PATH")
    return found


@dataclasses.dataclass
class Exit:
    """How a worker ended."""

    code: int  # what the launcher exits with for it: the exit code, or 128 + signal
    cause: str  # "exited with code 3", "was killed by signal 9 (SIGKILL)"


def _describe(status: str, mpiexec_code: int) -> Exit:
    kind, _, value = status.strip().rpartition("\n")[2].partition(" ")
    if kind == "signal":
        number = int(value)
        try:
            name = f" ({signal.Signals(number).name})"
        except ValueError:
            name = ""
        return Exit(128 + number, f"was killed by signal {number}{name}")
    if kind == "exit":
        return Exit(int(value), f"exited with code {value}")
    return Exit(mpiexec_code or 1, f"ended before it started (mpiexec exited with code "
                                   f"{mpiexec_code})")


class Worker:
    def __init__(self, rank: int, local_rank: int, command: List[str], env: Dict[str, str],
                 run_dir: Path, log: Optional[TextIO]) -> None:
        self.rank, self.local_rank = rank, local_rank
        self._status = run_dir / f"rank{rank}.status"
        self._status.write_text("")
        self.process = subprocess.Popen(
            [mpiexec(), "-n", "1", sys.executable, "-I", "-S", _SHIM, str(self._status),
             str(os.getpid()), "--", *command],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self._pump = threading.Thread(target=self._copy_output, args=(log,), daemon=True)
        self._pump.start()

    def _copy_output(self, log: Optional[TextIO]) -> None:
        prefix = f"[rank {self.rank}]: ".encode()
        for line in iter(self.process.stdout.readline, b""):
            if log is not None:
                log.write(line.decode(errors="replace"))
                log.flush()
                continue
            with _OUTPUT_LOCK:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()

    def poll(self) -> Optional[Exit]:
        """None while running, else how it ended."""
        code = self.process.poll()
        if code is None:
            return None
        return _describe(self._status.read_text(), code)

    def _session(self) -> Optional[int]:
        """The process id of the shim, leader of the worker's session (None before it wrote
        it)."""
        first = self._status.read_text().partition("\n")[0].split()
        return int(first[1]) if first[:1] == ["pid"] and len(first) == 2 else None

    def signal(self, sig: int) -> None:
        if self.process.poll() is not None:
            return  # mpiexec has reaped the session: the id may belong to someone else now
        session = self._session()
        try:
            if session is not None:
                os.killpg(session, sig)
            else:  # not started yet: mpiexec passes the signal on, or dies and takes it along
                self.process.send_signal(sig)
        except ProcessLookupError:
            pass  # it ended in the meantime

    def wait_output(self, seconds: float) -> None:
        self._pump.join(seconds)


def end_all(workers: List[Worker]) -> None:
    """SIGTERM every running worker, SIGKILL what is left after the grace period, reap."""
    for worker in workers:
        worker.signal(signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
    while time.monotonic() < deadline and any(w.process.poll() is None for w in workers):
        time.sleep(0.05)
    for worker in workers:
        worker.signal(signal.SIGKILL)
        if worker.process.poll() is None:
            worker.process.kill()
        worker.process.wait()
    for worker in workers:
        # a silently killed rank's watchdog still holds the pipe for its 1 s of news
        worker.wait_output(2.0)
