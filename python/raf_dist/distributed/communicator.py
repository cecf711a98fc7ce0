"""Process-group bootstrap under an MPI launcher or ``raf_dist.run``.

mpi4py initialises MPI (MPI_THREAD_MULTIPLE, which the native communication thread needs);
rank and size come from MPI, the local rank from MPI's shared-memory split
(``MPI_COMM_TYPE_SHARED``: right under MPICH and Open MPI, with ``-H``, ``--hostfile`` or
neither, without reading any launcher-specific variable, and where machines share a host
name). Started without a launcher, the world is one process. Started by
``raf_dist.run`` (its variables in the environment, a world of one from MPI's point of view),
the workers form their world through the rendezvous store (``rendezvous.py``): rank =
``RANK``, local rank = ``LOCAL_RANK``, and "same host" means "same launcher node".

The native runtime receives the communicator by address (``MPI._addressof``): MPICH's derived
handles do not fit a Python int conversion, and the native side duplicates it so background
collectives never interleave with Python's own MPI calls.
"""
import atexit
import contextlib
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from .. import _native, process_memory
from . import settings
from . import config, rendezvous, watchdog

logger = logging.getLogger("raf_dist")
_BARRIER_TAG = 0x7AF1  # idle_barrier's arrival messages, apart from any other Python message
_AGREE_TAG = 0x7AF2  # agree()'s values, to rank 0 and back


class Communicator:
    """This process's place in the job.

    Attributes:
        rank, size: position in and size of the world.
        local_rank, local_size: position among / number of ranks on this host.
        host: this host's name as MPI reports it.
        group: id of the native process group (argument of ``raf_dist.ccl.*``).
        mpi_comm: the mpi4py communicator (for Python-side control messages).
    """

    def __init__(self, mpi_comm, check_collectives, placement=None, reach_address=None):
        from mpi4py import MPI

        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.host = MPI.Get_processor_name() or socket.gethostname()
        self.hosts = mpi_comm.allgather(self.host)
        # which ranks share a host: MPI's shared-memory split under an MPI launcher (host
        # names may repeat across machines: containers), the launcher's node under raf_dist.run
        node = _shared_memory_node(mpi_comm) if placement is None else placement.node_rank
        self._nodes = mpi_comm.allgather(node)
        self.local_rank = sum(1 for h in self._nodes[: self.rank] if h == node)
        self.local_size = sum(1 for h in self._nodes if h == node)
        if placement is not None and (self.local_rank, self.local_size) != (
                placement.local_rank, placement.local_world_size):
            raise rendezvous.RendezvousError(
                f"rank {self.rank}: the launcher set LOCAL_RANK={placement.local_rank} of "
                f"LOCAL_WORLD_SIZE={placement.local_world_size}, the world says local rank "
                f"{self.local_rank} of {self.local_size}")
        self._reach_address = reach_address
        self.group = int(_native.func("init_group")(MPI._addressof(mpi_comm), check_collectives))

        self._activity = None
        self._watchdog = None  # (process, pipe fd) in a multi-rank job, see watchdog.py
        self.failure = None  # what ended this rank's part in the job (fail()), or None

    @property
    def activity(self):
        """What this rank is doing (e.g. "step 12"), set by the Trainer; failure messages (its
        own, and its watchdog's if it dies silently) name it."""
        return self._activity

    @activity.setter
    def activity(self, value):
        self._activity = value
        self._tell_watchdog(f"A {value or ''}")

    def _tell_watchdog(self, line):
        if self._watchdog is None:
            return
        try:
            os.write(self._watchdog[1], (line.replace("\n", " ") + "\n").encode())
        except OSError:  # the watchdog is gone; carry on without it
            self._watchdog = None

    def start_watchdog(self, grace_seconds):
        """Start this rank's watchdog (``watchdog.py``) and introduce the watchdogs to each
        other; collective. A rank that later dies without a word is named, with its activity,
        by its watchdog, and the others end within ``grace_seconds`` (plus a few seconds)."""
        read_end, write_end = os.pipe()
        # a job on one host needs no datagram from outside it: listen on loopback only
        bind = "127.0.0.1" if len(set(self._nodes)) == 1 else "0.0.0.0"
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(Path(__file__).with_name("watchdog.py")),
                 str(self.rank), str(self.size), self.host, str(os.getpid()), str(grace_seconds),
                 bind],
                stdin=read_end, stdout=subprocess.PIPE, start_new_session=True, close_fds=True)
            port = int(process.stdout.readline())
            process.stdout.close()
        except (OSError, ValueError):
            port = None
        finally:
            os.close(read_end)
        addresses = self.mpi_comm.allgather(
            (reachable_addresses(self.host, self._reach_address), port))
        # the watchdogs drop datagrams without the job's token (across hosts their port is open)
        token = self.mpi_comm.bcast(secrets.token_hex(16) if self.rank == 0 else None, root=0)
        if port is None:
            os.close(write_end)
            return
        self._watchdog = (process, write_end)
        self._tell_watchdog(f"T {token}")
        for peer, (ips, peer_port) in enumerate(addresses):
            if peer != self.rank and peer_port is not None:
                ips = ["127.0.0.1"] if self._nodes[peer] == self._nodes[self.rank] else ips
                self._tell_watchdog(f"P {peer} {','.join(ips)} {peer_port}")

    @contextlib.contextmanager
    def collective_work(self, activity: str, collective: bool = True):
        """Work in which the ranks meet in collectives (a step, a checkpoint save or load),
        named ``activity`` while it runs (the previous activity is restored after it). With
        ``collective=False`` (a Trainer local to this rank) it only names the activity.

        An exception that leaves it on one rank would leave the other ranks waiting in a
        collective this rank never joins — and catching it in the user's script would bypass
        the abort of an unhandled exception. So unless the exception says it was raised on
        every rank alike (``raised_on_every_rank``: a nonfinite loss, a checkpoint every rank
        refused), the rank ``fail()``s first: its collectives are shut off and the other
        ranks are ended, naming this rank, the activity and the error."""
        if self.failure is not None and collective:
            raise RuntimeError(f"{activity} refused: {self.failure}, so this rank's "
                               "collectives are shut off and the other ranks are being ended. "
                               "Restart the job (from the last checkpoint)")
        previous = self._activity
        self.activity = activity
        try:
            yield
        except BaseException as exc:
            if collective and not getattr(exc, RAISED_ON_EVERY_RANK, False):
                self.fail(f"{type(exc).__name__}: {_first_line(exc)}")
            else:  # the job goes on: every rank is back where it was
                self.activity = previous
            raise
        self.activity = previous

    def fail(self, error: str) -> None:
        """This rank cannot go on with the job (``error`` happened during its current
        activity): shut off its collectives (a later one raises naming the failure; exit
        does not wait for peers) and tell the other ranks' watchdogs, which end their ranks.
        Idempotent; no-op in a world of one."""
        if self.failure is not None or self.size == 1:
            return
        during = f" during {self.activity}" if self.activity else ""
        self.failure = f"rank {self.rank}/{self.size} on {self.host} failed{during}: {error}"[:500]
        _native.func("abort")(self.failure)
        sys.stderr.write(f"[raf_dist] {self.failure}; this rank's collectives are shut off "
                         "and the other ranks are being ended\n")
        sys.stderr.flush()
        self.leaving(self.failure)

    @property
    def has_watchdog(self):
        return self._watchdog is not None

    def leaving(self, failure=None):
        """This rank ends on purpose: normally (its watchdog stays silent) or, with
        ``failure`` (what happened, already printed by this rank), aborting the job (its
        watchdog tells the others' watchdogs, which name this rank and the failure)."""
        self._tell_watchdog(f"F {failure}" if failure else "X")

    def idle_barrier(self, what: str = "barrier", timeout_s: "float | None" = -1.0,
                     poll_seconds: float = 0.005) -> None:
        """A barrier that sleeps while it waits. MPICH's blocking barrier busy-polls, so ranks
        waiting for another's long local work (compiling, checkpoint I/O) would steal the
        cores that work needs when ranks share a host.

        It raises TimeoutError naming ``what`` after ``timeout_s`` seconds (default:
        RAF_DIST_BARRIER_TIMEOUT_S; None: wait forever). Every rank also tells rank 0 that it
        arrived (a small message), so rank 0's error names the ranks that never did."""
        timeout = settings.barrier_timeout_s() if timeout_s == -1.0 else timeout_s
        if self.rank == 0:
            arrivals = {r: self.mpi_comm.irecv(source=r, tag=_BARRIER_TAG)
                        for r in range(1, self.size)}
        else:
            arrivals = {0: self.mpi_comm.isend(None, dest=0, tag=_BARRIER_TAG)}
        request = self.mpi_comm.Ibarrier()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not request.Test():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(self._barrier_timeout_message(what, timeout, arrivals))
            time.sleep(poll_seconds)
        for arrival in arrivals.values():
            arrival.wait()

    def agree(self, value, what: str, poll_seconds: float = 0.002) -> list:
        """Every rank's ``value`` (small, picklable), in rank order, on every rank: an
        allgather that sleeps while it waits and gives up after RAF_DIST_BARRIER_TIMEOUT_S
        (TimeoutError naming ``what``), as idle_barrier. For the agreements around checkpoint
        I/O, where a rank may wait for another's slow disk but must not wait forever for a
        stalled one (mpi4py's object collectives have no nonblocking form to time out)."""
        if self.size == 1:
            return [value]
        timeout = settings.barrier_timeout_s()
        deadline = None if timeout is None else time.monotonic() + timeout

        def finish(requests):
            values, pending = [None] * len(requests), set(range(len(requests)))
            while True:
                for i in list(pending):  # a completed request gives its value only once
                    flag, received = requests[i].test()
                    if flag:
                        values[i] = received
                        pending.discard(i)
                if not pending:
                    return values
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank {self.rank}/{self.size}: {what} did not complete within "
                        f"{timeout:g} s (RAF_DIST_BARRIER_TIMEOUT_S); a rank is stuck or dead."
                        f"{_flight_recorder()}")
                time.sleep(poll_seconds)

        if self.rank == 0:
            values = [value] + finish([self.mpi_comm.irecv(source=r, tag=_AGREE_TAG)
                                       for r in range(1, self.size)])
            finish([self.mpi_comm.isend(values, dest=r, tag=_AGREE_TAG)
                    for r in range(1, self.size)])
            return values
        finish([self.mpi_comm.isend(value, dest=0, tag=_AGREE_TAG)])
        return finish([self.mpi_comm.irecv(source=0, tag=_AGREE_TAG)])[0]

    def _barrier_timeout_message(self, what, timeout, arrivals):
        if self.rank == 0:
            missing = [r for r, arrival in arrivals.items() if not arrival.test()[0]]
            who = (f"rank(s) {', '.join(map(str, missing))} never arrived" if missing else
                   "every rank arrived but the barrier did not complete")
        else:
            who = "rank 0's message names the ranks that never arrived"
        return (f"rank {self.rank}/{self.size}: {what} did not complete within {timeout:g} s "
                f"(RAF_DIST_BARRIER_TIMEOUT_S); {who}. A rank is stuck or dead in the work "
                f"before it (compiling, checkpoint I/O), or runs a different program."
                f"{_flight_recorder()}")

    def __repr__(self):
        return (
            f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, host={self.host!r})"
        )


_LOCK = threading.Lock()
_COMM = None
#: an exception with this attribute set true was raised on every rank alike (the ranks agreed
#: on it, as on a nonfinite global loss or a refused checkpoint): the job may go on after it
RAISED_ON_EVERY_RANK = "raf_dist_raised_on_every_rank"


def raised_on_every_rank(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised by every rank alike (see Communicator.collective_work)."""
    setattr(exc, RAISED_ON_EVERY_RANK, True)
    return exc


def _first_line(exc) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _shared_memory_node(mpi_comm):
    """An id of this rank's node, equal on exactly the ranks that share memory with it: the
    lowest world rank of its MPI_COMM_TYPE_SHARED group (MPI's own notion of a node, not the
    host name)."""
    from mpi4py import MPI

    local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return local.allreduce(mpi_comm.Get_rank(), op=MPI.MIN)
    finally:
        local.Free()


def reachable_addresses(host, reach_address=None, limit=4):
    """IPv4 addresses at which watchdogs on other hosts may reach this host's, most likely
    first: the address it reaches node 0's rendezvous store from (under raf_dist.run), the
    source address of its default route, then what its name resolves to, loopback only when
    nothing else is found (a name that resolves to 127.0.1.1 alone, as Debian's /etc/hosts
    makes it, must not leave the watchdog unreachable). News goes to all of them."""
    found = [reach_address] if reach_address else []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: a UDP connect picks a route, sends nothing
            found.append(probe.getsockname()[0])
    except OSError:
        pass  # no default route
    try:
        found += [info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)]
    except OSError:
        pass
    outward = [ip for ip in dict.fromkeys(found) if not ip.startswith("127.") and ip != "0.0.0.0"]
    return outward[:limit] or ["127.0.0.1"]


def get_communicator():
    """The world communicator, created on first call (collectively: every rank must call it)."""
    global _COMM
    with _LOCK:
        if _COMM is None:
            timeout = settings.collective_timeout_s()  # a bad value fails here, before any MPI call
            config.runtime_started()  # from here on the runtime settings are in force
            with process_memory.measuring(process_memory.MPI):  # stats()'s library_bytes
                _COMM = _start_world(timeout)
            atexit.register(_shutdown)
            _install_abort_on_exception(_COMM)
            if _COMM.size > 1 and settings.watchdog_enabled():
                _COMM.start_watchdog(settings.watchdog_grace_s())
        return _COMM


def load_mpi() -> None:
    """Load the MPI library as starting the world does (mpi4py's import initialises MPI; no
    communicator, no collective), measured under ``process_memory.MPI``: what
    ``estimate_memory`` adds for a run's MPI without starting one."""
    with process_memory.measuring(process_memory.MPI):
        from mpi4py import MPI  # noqa: F401  (the import is the load)


def _start_world(timeout):
    """MPI started (mpi4py's import initialises it), the native runtime loaded, and the world
    communicator (get_communicator)."""
    # the native runtime takes the validated value (0 = none) before any group. With a
    # timeout, blocking collectives also run on the communication thread
    # (src/ccl/mpi_backend.cc: a wait can give up, an MPI call cannot)
    _native.func("set_timeout")(float(timeout or 0))
    from mpi4py import MPI

    check = settings.check_collectives()
    placement = rendezvous.placement_from_environment()
    if placement is not None and MPI.COMM_WORLD.Get_size() > 1:
        # raf_dist.run's variables inherited into an mpirun job: MPI's world wins
        logger.warning("raf_dist.run's variables are set but MPI started %d ranks: "
                       "using MPI's world", MPI.COMM_WORLD.Get_size())
        placement = None
    if placement is None:
        return Communicator(MPI.COMM_WORLD, check)
    world, reach_address = rendezvous.join_world(placement)
    return Communicator(world, check, placement, reach_address)


def _shutdown():
    """At exit: say goodbye to the watchdog, finish outstanding collectives and stop the
    communication threads before MPI_Finalize (mpi4py finalizes after the atexit handlers
    run). After a failure (fail(), or a collective that timed out) nothing is waited for:
    a communication thread may be stuck in MPI waiting for a dead peer, and MPI_Finalize
    could wait for it too, so the rank ends at once with exit status 1 (the job failed)."""
    comm = _COMM
    broken = str(_native.func("broken")())
    if comm is not None:
        if broken and comm.failure is None and comm.size > 1:
            comm.fail(broken.splitlines()[0])
        elif comm.failure is None:
            comm.leaving()
    _native.func("shutdown")()
    if broken or (comm is not None and comm.failure is not None):
        sys.stdout.flush()
        sys.stderr.write(f"[raf_dist] rank {comm.rank}/{comm.size}: exit status 1: the job "
                         f"failed ({(comm.failure or broken).splitlines()[0]})\n")
        sys.stderr.flush()
        os._exit(1)


def _install_abort_on_exception(comm):
    """An unhandled exception on any rank, in its main thread or any other, ends the whole
    job at once instead of leaving the other ranks blocked in their next collective: print
    the traceback under the rank's name, then MPI_Abort, which makes the launcher kill every
    rank and exit non-zero. (A thread's exception would otherwise only be printed: a data
    loading thread that died leaves the main thread waiting for batches forever.)"""
    if comm.size == 1:
        return
    previous, previous_thread_hook = sys.excepthook, threading.excepthook

    def abort_job(exc_type, exc, tb, thread=None):
        where = "" if thread is None else f" in thread {thread.name!r}"
        message = "".join(traceback.format_exception(exc_type, exc, tb))
        during = f" during {comm.activity}" if comm.activity else ""
        sys.stderr.write(
            f"[raf_dist] rank {comm.rank}/{comm.size} on {comm.host} failed{where}{during}; "
            f"aborting the job:\n{message}"
        )
        sys.stderr.flush()
        if comm.failure is None:  # else the others were told when it happened
            comm.leaving(f"rank {comm.rank}/{comm.size} on {comm.host} failed{where}{during}: "
                         f"{exc_type.__name__}: {_first_line(exc)}"[:500])
        if comm.has_watchdog:  # the other ranks' watchdogs print the news before the abort
            time.sleep(watchdog.NEWS_SECONDS)
        comm.mpi_comm.Abort(1)

    def main_thread(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            return previous(exc_type, exc, tb)
        abort_job(exc_type, exc, tb)

    def other_thread(args):
        if args.exc_type is SystemExit:  # a thread's sys.exit() ends only the thread
            return previous_thread_hook(args)
        abort_job(args.exc_type, args.exc_value, args.exc_traceback, args.thread)

    sys.excepthook = main_thread
    threading.excepthook = other_thread


def _flight_recorder() -> str:
    """This rank's last collectives for a barrier or agreement timeout, as a collective timeout
    lists them (what the other ranks last did together says where the stuck one stopped)."""
    try:  # what collectives.recent_collectives returns (collectives imports this module)
        recent = str(_native.func("recent_collectives")())
    except Exception:  # noqa: BLE001 - the native runtime not loaded: the message goes without
        return ""
    return f" This rank's last collectives (flight recorder):{recent or ' (none yet)'}"
