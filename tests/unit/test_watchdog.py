"""The per-rank watchdog (raf_dist/distributed/watchdog.py) without MPI: two stand-in ranks
(sleep processes) with their watchdogs introduced to each other, as Communicator does."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import raf_dist.distributed.watchdog as watchdog

SCRIPT = str(Path(watchdog.__file__))


def _start(rank, pid, grace, stderr):
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-I", "-S", SCRIPT, str(rank), "2", "testhost",
                             str(pid), str(grace)], stdin=read_end, stdout=subprocess.PIPE,
                            stderr=stderr, start_new_session=True)
    os.close(read_end)
    port = int(proc.stdout.readline())
    return proc, write_end, port


def _pair(tmp_path, grace=1.0):
    ranks = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]
    logs = [open(tmp_path / f"watchdog{r}.txt", "w") for r in range(2)]
    dogs = [_start(r, ranks[r].pid, grace, logs[r]) for r in range(2)]
    for r, (_, pipe, _) in enumerate(dogs):
        peer = 1 - r
        # two addresses, the first unreachable (TEST-NET-1): news must still arrive
        os.write(pipe, f"P {peer} 192.0.2.1,127.0.0.1 {dogs[peer][2]}\nA step 7 (last completed: 6)\n".encode())
    return ranks, dogs, logs


def _finish(ranks, dogs, logs):
    for _, pipe, _ in dogs:  # the stand-ins leave on purpose from here on
        try:
            os.write(pipe, b"X\n")
        except OSError:
            pass
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
        rank.wait()
    for proc, pipe, _ in dogs:
        try:
            os.close(pipe)
        except OSError:
            pass
        proc.wait(timeout=30)
    for log in logs:
        log.close()


def test_a_silent_death_is_named_and_the_other_rank_is_ended(tmp_path):
    ranks, dogs, logs = _pair(tmp_path)
    try:
        start = time.monotonic()
        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].wait()
        assert ranks[0].wait(timeout=20) == -signal.SIGTERM  # ended by its watchdog
        elapsed = time.monotonic() - start
    finally:
        _finish(ranks, dogs, logs)
    died = (tmp_path / "watchdog1.txt").read_text()
    ended = (tmp_path / "watchdog0.txt").read_text()
    assert "rank 1/2 on testhost" in died and "died during step 7 (last completed: 6) without raising" in died, died
    assert "rank 0/2 on testhost: ending the job: rank 1/2 on testhost" in ended, ended
    assert "during step 7 (last completed: 6)" in ended, ended
    assert elapsed < 10, elapsed  # detection (<= 1 s poll) + 1 s grace + news time


def test_a_rank_that_leaves_on_purpose_is_not_reported(tmp_path):
    """Rank 1 completed step 7 (the one rank 0 is finishing) and ended its program: rank 0
    does not need it any more."""
    ranks, dogs, logs = _pair(tmp_path)
    try:
        os.write(dogs[1][1], b"A work between steps (last completed: 7)\nX\n")
        os.close(dogs[1][1])
        dogs[1][0].wait(timeout=10)  # the watchdog ends with its rank's pipe
        ranks[1].kill()
        ranks[1].wait()
        time.sleep(2.5)
        assert ranks[0].poll() is None  # nobody was told to end
    finally:
        _finish(ranks, dogs, logs)
    assert (tmp_path / "watchdog1.txt").read_text() == ""
    assert (tmp_path / "watchdog0.txt").read_text() == ""


def test_a_rank_that_leaves_in_the_middle_of_training_ends_the_job(tmp_path):
    """Rank 1 returned after step 6 while rank 0 runs step 7 (which needs it): rank 0's
    watchdog names rank 1 and ends rank 0 within seconds, not after the collective timeout."""
    ranks, dogs, logs = _pair(tmp_path)
    try:
        start = time.monotonic()
        os.write(dogs[1][1], b"A work between steps (last completed: 6)\nX\n")
        os.close(dogs[1][1])
        assert ranks[0].wait(timeout=20) == -signal.SIGTERM
        elapsed = time.monotonic() - start
    finally:
        _finish(ranks, dogs, logs)
    said = (tmp_path / "watchdog0.txt").read_text()
    assert ("rank 0/2 on testhost: ending the job: rank 1/2 on testhost (pid" in said
            and "left the job (its program ended: returned or sys.exit) during work between "
                "steps (last completed: 6); this rank is in step 7 (last completed: 6), which "
                "needs it" in said), said
    assert watchdog.CONFIRM_SECONDS <= elapsed < 10, elapsed


def test_a_reported_failure_reaches_the_other_rank(tmp_path):
    ranks, dogs, logs = _pair(tmp_path)
    try:
        os.write(dogs[1][1], b"F rank 1/2 on testhost failed during step 7 (last completed: 6): ValueError: bad\n")
        assert ranks[0].wait(timeout=20) == -signal.SIGTERM
    finally:
        _finish(ranks, dogs, logs)
    assert (tmp_path / "watchdog1.txt").read_text() == ""  # the rank printed it itself
    assert ("ending the job: rank 1/2 on testhost failed during step 7 (last completed: 6): ValueError: bad"
            in (tmp_path / "watchdog0.txt").read_text())


def test_watchdog_addresses_prefer_outward_ones():
    from raf_dist.distributed.communicator import reachable_addresses

    ips = reachable_addresses(socket.gethostname())
    assert ips and all(len(ip.split(".")) == 4 for ip in ips)
    assert ips == ["127.0.0.1"] or not any(ip.startswith("127.") for ip in ips)
    # unresolvable: the route's address, or loopback
    assert reachable_addresses("no-such-host.invalid")

def test_stray_datagrams_are_dropped_and_the_jobs_news_still_arrives(tmp_path):
    rank = subprocess.Popen(["sleep", "120"])
    with open(tmp_path / "watchdog.txt", "w") as log:
        dog, pipe, port = _start(0, rank.pid, 0.5, log)
    os.write(pipe, b"T s3cret\nA step 4\n")
    time.sleep(0.2)  # the token is read before the first datagram
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        for stray in (b"1.0 D rank 9/9 on h died",          # the format before tokens
                      b"other\n1.0 D rank 9/9 on h died",   # another job's
                      b"s3cret\nnan D rank 9/9 on h died",    # a time that never orders
                      b"s3cret\nsoon D rank 9/9 on h died",   # a time that does not parse
                      b"s3cret\n" + b"7" * 9000,            # longer than any news
                      b"\xff\xfe\x00garbage"):
            udp.sendto(stray, ("127.0.0.1", port))
        time.sleep(1.5)
        assert rank.poll() is None and dog.poll() is None, "a stray datagram ended the rank"
        udp.sendto(b"s3cret\n1.0 D rank 9/9 on h died during step 3", ("127.0.0.1", port))
        rank.wait(timeout=30)  # ended after the 0.5 s grace
    dog.wait(timeout=30)
    os.close(pipe)
    said = (tmp_path / "watchdog.txt").read_text()
    assert "rank 0/2 on testhost: ending the job: rank 9/9 on h died during step 3" in said, said
    assert said.count("ending the job") == 1, said
