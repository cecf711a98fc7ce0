"""The build cache's lock (raf_dist.compiler.build.build_lock): a second process building the
same step waits for the first and then loads its library instead of compiling it again."""
import subprocess
import sys
import time

from raf_dist.compiler.build import build_lock

CHILD = """
import sys, time
from pathlib import Path
from raf_dist.compiler.build import build_lock
print("ready", flush=True)
start = time.monotonic()
with build_lock(Path(sys.argv[1])):
    print(time.monotonic() - start, flush=True)
"""


def test_a_second_build_of_the_same_step_waits_for_the_first(tmp_path):
    lock = tmp_path / "step-0123.lock"
    with build_lock(lock):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(lock)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(1.0)
            assert child.poll() is None  # still waiting for this process's build
        except BaseException:
            child.kill()
            raise
    waited = float(child.communicate(timeout=60)[0])
    assert waited >= 0.5, waited
    assert child.returncode == 0


def test_a_killed_builder_does_not_block_the_next(tmp_path):
    """The kernel drops a flock with its holder: a rank killed mid-build leaves no stale lock."""
    lock = tmp_path / "step-4567.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\n"
         "h = open(sys.argv[1], 'a'); fcntl.flock(h, fcntl.LOCK_EX); print('held', flush=True)\n"
         "time.sleep(600)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()
        holder.wait(timeout=60)
    start = time.monotonic()
    with build_lock(lock):
        pass
    assert time.monotonic() - start < 5
