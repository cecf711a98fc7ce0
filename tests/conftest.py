import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/mpi_launch.py, tests/models.py

# Compiled steps are cached per test session (never in the user's cache); subprocesses inherit it.
os.environ.setdefault("RAF_DIST_CACHE_DIR", tempfile.mkdtemp(prefix="raf_dist_test_cache_"))
