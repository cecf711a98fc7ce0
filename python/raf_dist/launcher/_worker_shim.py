"""Runs one worker of raf_dist.run and reports how it ended. Standard library only, run by path.

Started as ``mpiexec -n 1 python -I -S _worker_shim.py STATUS_FILE LAUNCHER_PID -- CMD...``:
the worker (CMD) is this process's child and inherits MPI's process-manager connection
(``PMI_FD``, hence ``close_fds=False``), so it is the MPI process. The shim exists because
``mpiexec`` reports a worker killed by signal 9 and one that exited with code 9 alike, and
hides the worker's process id in a session of its own; the shim writes, to STATUS_FILE,
``pid <its pid>`` at once (the launcher ends the worker by signalling that session) and
``exit <code>`` or ``signal <number>`` at the end. If the launcher dies (SIGKILL leaves no
chance to clean up) the shim ends the worker rather than leave it running unowned.
"""
import os
import signal
import subprocess
import sys

#: how often the shim checks that its launcher still exists
_POLL_SECONDS = 0.5


def _launcher_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(status_file, launcher_pid, command):
    # The launcher signals the whole session; the shim must outlive the worker to report how
    # it ended. A handler (not SIG_IGN, which the worker would inherit) is reset by exec.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    with open(status_file, "w") as status:
        status.write(f"pid {os.getpid()}\n")
        status.flush()
        worker = subprocess.Popen(command, close_fds=False)
        while True:
            try:
                code = worker.wait(timeout=_POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if not _launcher_alive(launcher_pid):
                    os.killpg(0, signal.SIGKILL)  # this session: the worker and the shim
        status.write(f"signal {-code}\n" if code < 0 else f"exit {code}\n")
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    if len(sys.argv) < 5 or sys.argv[3] != "--":
        sys.exit("usage: _worker_shim.py STATUS_FILE LAUNCHER_PID -- COMMAND...")
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[4:]))
