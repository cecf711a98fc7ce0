import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/mpi_launch.py, tests/models.py

# Compiled steps are cached per test session (never in the user's cache); subprocesses inherit it,
# pytest-xdist's workers too (the controller sets it before it starts them).
os.environ.setdefault("RAF_DIST_CACHE_DIR", tempfile.mkdtemp(prefix="raf_dist_test_cache_"))


@pytest.fixture(autouse=True)
def strict_schedules(monkeypatch):
    """Every test runs strict: a kernel ScheduleCPU cannot schedule fails the test instead of
    running unscheduled (raf_dist.env). Processes a test starts (mpiexec ranks) inherit it.
    A test about the non-strict behaviour passes ``strict=False`` to ScheduleCPU."""
    monkeypatch.setenv("RAF_DIST_STRICT_SCHEDULE", "1")


@pytest.fixture
def dist_config():
    """``raf_dist.distributed.get_config()`` at its defaults, and back at its defaults after the
    test whatever it set (or raised). For tests that set the config in this process; worker
    scripts under mpiexec run in processes of their own and set theirs themselves."""
    from raf_dist import distributed as dist

    config = dist.get_config().reset()
    yield config
    config.reset()
