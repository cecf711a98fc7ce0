"""A per-rank watchdog process: names a rank that dies without a word, and ends the others.

A rank killed by a signal (SIGKILL, the OOM killer) runs no code: no exception handler can
say which rank it was or what it was doing, and the launcher's own report names only a PID.
So every rank of a multi-rank job starts one small watchdog (this file, run by path: it
imports nothing but the standard library) in its own session, so that the launcher's clean-up
of the rank leaves it alone:

- the rank keeps a pipe to the watchdog's stdin and writes what it is doing ("step 12")
  whenever that changes (``Communicator.activity``), "X" when it exits normally, and
  "F <what happened>" when it aborts the job after printing its own failure message (the
  watchdog passes that on, so the others know their ranks are ended because of it);
- the watchdogs know each other's UDP addresses (the ranks exchange them once over MPI);
- when the pipe reaches end-of-file (or the rank's PID is gone) without "X", the rank died
  silently: its watchdog sends the news, with the time, to every other watchdog, listens
  NEWS_SECONDS for news of an earlier death (the launcher kills every rank once one dies,
  and those watchdogs find their ranks dead too), then prints either ``[raf_dist] rank R/N on
  HOST (pid P) died during step S without raising an error ...`` (it was first) or the
  earlier news;
- a watchdog that receives news (of a silent death or of a failure) prints ``[raf_dist] rank r/N on HOST: ending the job:
  rank R/N ... died during step S`` and, if the launcher has not ended its rank within
  ``grace`` seconds, terminates it (SIGTERM, then SIGKILL): every rank exits non-zero
  with a message naming the dead rank and its step, even under a launcher that would let the
  survivors wait in their next collective.

Run as: python watchdog.py RANK SIZE HOST PID GRACE_SECONDS. Protocol on stdin, one line each:
``T <token>`` (the job's token, before any peer), ``A <activity>``, ``P <rank>
<ip>[,<ip>...] <port>`` (a peer, news goes to each of its addresses), ``X``, ``F <news>``.
The watchdog prints its UDP port as the first line on stdout, then closes stdout.

Datagrams are ``<token>\n<time> <news>``: the ranks agree on a random token per job (rank
0's, passed over MPI, never on a command line), and a datagram without it, or one that does
not parse, is dropped. The port listens on every interface (peers on other hosts must reach
it), so without the token any stray packet could end a job.
"""
import hmac
import os
import select
import signal
import socket
import sys
import time

#: how long news takes to reach the other watchdogs and be printed, with room to spare; also
#: how long a watchdog whose rank was found dead listens for news of an earlier death
NEWS_SECONDS = 1.0


def _alive(pid):
    """The process exists and is not a zombie (a killed rank its launcher has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc: trust kill(0)


def _say(text):
    """Print to the rank's stderr, then let go of it: a launcher waits for the end of every
    copy of a rank's output before it considers the rank gone."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except OSError:
        pass  # the launcher is gone: nobody to tell
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _end_rank(pid, grace):
    """Give the launcher ``grace`` seconds to end the rank, then end it ourselves."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)


def _tell(udp, peers, rank, when, news, token):
    for peer, addresses in peers.items():
        for address in addresses if peer != rank else ():
            try:
                udp.sendto(f"{token}\n{when:.6f} {news}".encode()[:_MAX_DATAGRAM], address)
            except OSError:
                pass


#: news is one line of text; anything longer is cut here and refused on receipt
_MAX_DATAGRAM = 4096


def _parse(datagram, token):
    """(time, news) of a datagram from a peer watchdog of this job, else None."""
    try:
        theirs, _, body = datagram.decode().partition("\n")
        when, _, news = body.partition(" ")
        when = float(when)
    except (UnicodeDecodeError, ValueError):
        return None
    if not hmac.compare_digest(theirs.encode(), token.encode()) or not news or when != when:
        return None  # another job's, or a stray packet's; NaN never orders
    return when, news


def main(rank, size, host, pid, grace, bind="0.0.0.0"):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((bind, 0))
    sys.stdout.write(f"{udp.getsockname()[1]}\n")
    sys.stdout.flush()
    sys.stdout.close()
    me = f"rank {rank}/{size} on {host}"
    peers, activity, leaving, buffered = {}, None, False, b""
    token = "-"  # until the rank sends the job's
    heard = []  # (time, news) from the other watchdogs
    died_at = None  # wall-clock time this rank was found dead without having said goodbye
    stdin = sys.stdin.buffer.raw
    while True:
        ready, _, _ = select.select([udp] + ([stdin] if died_at is None else []), [], [], 0.1)
        heard_now = _parse(udp.recv(_MAX_DATAGRAM + 1), token) if udp in ready else None
        if heard_now is not None:
            when, news = heard_now
            heard.append(heard_now)
            if not leaving and died_at is None:  # our rank is alive: a survivor
                leaving = True
                _say(f"[raf_dist] {me}: ending the job: {news}")
                _end_rank(pid, grace)
        if died_at is not None:
            # Several ranks may be found dead: the launcher kills the others once one dies.
            # Each waits NEWS_SECONDS for the others' news; the first to die is the cause.
            if time.time() < died_at + NEWS_SECONDS:
                continue
            earlier = sorted(n for n in heard if n[0] < died_at)
            if earlier:
                _say(f"[raf_dist] {me}: ending the job: {earlier[0][1]}")
            else:
                during = f" during {activity}" if activity else ""
                _say(f"[raf_dist] rank {rank}/{size} on {host} (pid {pid}) died{during} without "
                     f"raising an error (killed by a signal: SIGKILL, the out-of-memory killer, "
                     f"...); the job ends")
            return
        if stdin in ready or not _alive(pid):
            chunk = os.read(stdin.fileno(), 65536) if stdin in ready else b""
            if chunk:
                buffered += chunk
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    kind, _, rest = line.decode(errors="replace").partition(" ")
                    if kind == "A":
                        activity = rest or None
                    elif kind == "P":
                        peer, ips, port = rest.split()
                        peers[int(peer)] = [(ip, int(port)) for ip in ips.split(",")]
                    elif kind == "X":
                        leaving = True
                    elif kind == "T":
                        token = rest
                    elif kind == "F":  # the rank printed its failure; the others hear it here
                        leaving = True
                        _tell(udp, peers, rank, time.time(), rest, token)
                continue
            if leaving:
                return
            died_at = time.time()  # end of file without "X": the rank died without a word
            during = f" during {activity}" if activity else ""
            _tell(udp, peers, rank, died_at,
                  f"rank {rank}/{size} on {host} (pid {pid}) died{during} without raising an "
                  f"error (killed by a signal: SIGKILL, the out-of-memory killer, ...)", token)


if __name__ == "__main__":
    r, n, h, p, g = sys.argv[1:6]
    main(int(r), int(n), h, int(p), float(g), *sys.argv[6:7])
