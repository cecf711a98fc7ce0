"""Process-group bootstrap under an MPI launcher.

mpi4py initialises MPI (MPI_THREAD_MULTIPLE, which the native communication thread needs);
rank and size come from MPI, the local rank from an exchange of host names (so it is right
under MPICH and Open MPI, with ``-H``, ``--hostfile`` or neither, without reading any
launcher-specific variable). Started without a launcher, the world is one process.

The native runtime receives the communicator by address (``MPI._addressof``): MPICH's derived
handles do not fit a Python int conversion, and the native side duplicates it so background
collectives never interleave with Python's own MPI calls.
"""
import atexit
import os
import socket
import sys
import threading
import traceback

from .. import _native


class Communicator:
    """This process's place in the job.

    Attributes:
        rank, size: position in and size of the world.
        local_rank, local_size: position among / number of ranks on this host.
        host: this host's name as MPI reports it.
        group: id of the native process group (argument of ``raf_dist.ccl.*``).
        mpi_comm: the mpi4py communicator (for Python-side control messages).
    """

    def __init__(self, mpi_comm, check_collectives):
        from mpi4py import MPI

        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.host = MPI.Get_processor_name() or socket.gethostname()
        hosts = mpi_comm.allgather(self.host)
        self.local_rank = sum(1 for h in hosts[: self.rank] if h == self.host)
        self.local_size = sum(1 for h in hosts if h == self.host)
        self.hosts = hosts
        self.group = int(_native.func("init_group")(MPI._addressof(mpi_comm), check_collectives))

    #: what this rank is doing (e.g. "step 12"), set by the Trainer; failure messages name it
    activity = None

    def idle_barrier(self, poll_seconds=0.005):
        """A barrier that sleeps while it waits. MPICH's blocking barrier busy-polls, so ranks
        waiting for another's long local work (compiling, checkpoint I/O) would steal the
        cores that work needs when ranks share a host."""
        import time

        request = self.mpi_comm.Ibarrier()
        while not request.Test():
            time.sleep(poll_seconds)

    def __repr__(self):
        return (
            f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, host={self.host!r})"
        )


_LOCK = threading.Lock()
_COMM = None


def get_communicator():
    """The world communicator, created on first call (collectively: every rank must call it)."""
    global _COMM
    with _LOCK:
        if _COMM is None:
            _native.load()
            from mpi4py import MPI

            check = os.environ.get("RAF_DIST_CHECK_COLLECTIVES", "0") not in ("", "0")
            _COMM = Communicator(MPI.COMM_WORLD, check)
            atexit.register(_shutdown)
            _install_abort_on_exception(_COMM)
        return _COMM


def _shutdown():
    """Finish outstanding collectives and stop the communication threads before MPI_Finalize
    (mpi4py finalizes after the atexit handlers run)."""
    _native.func("shutdown")()


def _install_abort_on_exception(comm):
    """An unhandled exception on any rank ends the whole job at once instead of leaving the
    other ranks blocked in their next collective: print the traceback under the rank's name,
    then MPI_Abort, which makes the launcher kill every rank and exit non-zero."""
    if comm.size == 1:
        return
    previous = sys.excepthook

    def abort_job(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            return previous(exc_type, exc, tb)
        message = "".join(traceback.format_exception(exc_type, exc, tb))
        during = f" during {comm.activity}" if comm.activity else ""
        sys.stderr.write(
            f"[raf_dist] rank {comm.rank}/{comm.size} on {comm.host} failed{during}; aborting "
            f"the job:\n{message}"
        )
        sys.stderr.flush()
        comm.mpi_comm.Abort(1)

    sys.excepthook = abort_job
