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

- a rank whose program ends normally while the others still need it (it returned, or called
  ``sys.exit(0)``, in the middle of training) says goodbye ("X") with its last activity; its
  watchdog tells the others that it left after step C. A survivor that is running a step
  beyond C, or is in a checkpoint save or load, can never complete it: once that has held for
  ``CONFIRM_SECONDS`` (a survivor a few milliseconds behind a peer that finished the same
  save is not stuck), its watchdog prints ``rank r/N on HOST: ending the job: rank R/N on
  HOST left the job (its program ended: returned or sys.exit) after step C ...`` and
  terminates it: the job ends in seconds, naming the rank that left, instead of waiting for
  the collective timeout.

Run as: python watchdog.py RANK SIZE HOST PID GRACE_SECONDS. Protocol on stdin, one line each:
``T <token>`` (the job's token, before any peer), ``A <activity>``, ``P <rank>
<ip>[,<ip>...] <port>`` (a peer, news goes to each of its addresses), ``X``, ``F <news>``.
The watchdog prints its UDP port as the first line on stdout, then closes stdout.

Datagrams are ``<token>\n<time> D <news>`` (a death or failure: end the job) or
``<token>\n<time> L <completed steps> <news>`` (a rank left normally): the ranks agree on a random token per job (rank
0's, passed over MPI, never on a command line), and a datagram without it, or one that does
not parse, is dropped. The port listens on every interface (peers on other hosts must reach
it), so without the token any stray packet could end a job.
"""
import hmac
import os
import re
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


def _tell(udp, peers, rank, when, news, token, kind="D"):
    for peer, addresses in peers.items():
        for address in addresses if peer != rank else ():
            try:
                udp.sendto(f"{token}\n{when:.6f} {kind} {news}".encode()[:_MAX_DATAGRAM],
                           address)
            except OSError:
                pass


#: how long a survivor must stay unable to finish (in a step beyond a departed peer's last, or
#: in a checkpoint save or load) before its watchdog ends it
CONFIRM_SECONDS = 2.0

#: the activities the ranks report (``Communicator.activity``, set by the Trainer): a running
#: step and the last completed one, or a checkpoint save / load, which every rank must join
_RUNNING = re.compile(r"^step (\d+) \(last completed: (\d+)\)")
_COMPLETED = re.compile(r"\(last completed: (\d+)\)")
_EVERY_RANK = ("saving checkpoint", "loading checkpoint", "building a Trainer")


def _completed(activity):
    """The last completed step an activity names, or None."""
    found = _COMPLETED.search(activity or "")
    return int(found.group(1)) if found else None


def _needs(activity, departed):
    """News of a departed peer (completed steps, news) that ``activity`` cannot finish
    without, or None."""
    running = _RUNNING.match(activity or "")
    for completed, news in departed:
        if running and completed is not None and int(running.group(1)) > completed:
            return news
        if (activity or "").startswith(_EVERY_RANK):
            return news
    return None


#: news is one line of text; anything longer is cut here and refused on receipt
_MAX_DATAGRAM = 4096


def _parse(datagram, token):
    """(time, kind, completed, news) of a datagram from a peer watchdog of this job, else
    None. ``kind`` is "D" (a death or failure) or "L" (a rank left after ``completed`` steps;
    None for a death)."""
    try:
        theirs, _, body = datagram.decode().partition("\n")
        when, kind, news = body.split(" ", 2)
        when, completed = float(when), None
        if kind == "L":
            completed, news = news.split(" ", 1)
            completed = None if completed == "-" else int(completed)
    except (UnicodeDecodeError, ValueError):
        return None
    if (not hmac.compare_digest(theirs.encode(), token.encode()) or kind not in ("D", "L")
            or not news or when != when):
        return None  # another job's, or a stray packet's; NaN never orders
    return when, kind, completed, news


def main(rank, size, host, pid, grace, bind="0.0.0.0"):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((bind, 0))
    sys.stdout.write(f"{udp.getsockname()[1]}\n")
    sys.stdout.flush()
    sys.stdout.close()
    me = f"rank {rank}/{size} on {host}"
    peers, activity, leaving, buffered = {}, None, False, b""
    token = "-"  # until the rank sends the job's
    heard = []  # (time, news) of deaths and failures from the other watchdogs
    departed = []  # (completed steps, news) of ranks whose programs ended normally
    stuck_since = None  # since when our rank cannot finish what it does without a departed one
    died_at = None  # wall-clock time this rank was found dead without having said goodbye
    stdin = sys.stdin.buffer.raw
    while True:
        ready, _, _ = select.select([udp] + ([stdin] if died_at is None else []), [], [], 0.1)
        heard_now = _parse(udp.recv(_MAX_DATAGRAM + 1), token) if udp in ready else None
        if heard_now is not None and heard_now[1] == "L":
            departed.append(heard_now[2:])
        elif heard_now is not None:
            when, _, _, news = heard_now
            heard.append((when, news))
            if not leaving and died_at is None:  # our rank is alive: a survivor
                leaving = True
                _say(f"[raf_dist] {me}: ending the job: {news}")
                _end_rank(pid, grace)
        needed = None if leaving or died_at is not None else _needs(activity, departed)
        stuck_since = None if needed is None else (stuck_since or time.monotonic())
        if needed is not None and time.monotonic() - stuck_since >= CONFIRM_SECONDS:
            leaving = True  # nobody else will end our rank: the one that left exited cleanly
            _say(f"[raf_dist] {me}: ending the job: {needed}; this rank is in {activity}, "
                 "which needs it")
            _end_rank(pid, 0.0)
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
                     f"raising an error (killed by a signal: SIGKILL, SIGTERM, the out-of-memory "
                     f"killer, ...); the job ends")
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
                        if activity is not None:  # the others may still need us: say when
                            completed = _completed(activity)
                            _tell(udp, peers, rank, time.time(),
                                  f"{'-' if completed is None else completed} rank {rank}/{size} "
                                  f"on {host} (pid {pid}) left the job (its program ended: "
                                  f"returned or sys.exit) during {activity}", token, kind="L")
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
                  f"error (killed by a signal: SIGKILL, SIGTERM, the out-of-memory killer, ...)",
                  token)


if __name__ == "__main__":
    r, n, h, p, g = sys.argv[1:6]
    main(int(r), int(n), h, int(p), float(g), *sys.argv[6:7])
