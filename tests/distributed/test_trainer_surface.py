"""Every public method and property of ``raf_dist.Trainer`` works on every layout — no
parallelism, data parallel (ZeRO-1), tensor parallel and pipelined — at any batch size, and
trains like one process on the same global batches (workers/surface_worker.py walks the
surface read from the class, so a member added later must be walked too)."""
import pytest

from mpi_launch import assert_ranks_ok, check_mpi


@pytest.mark.parametrize("layout", ["plain", "dp", "tp", "pp"])
def test_every_public_member_works_on_every_layout(layout, tmp_path):
    out = check_mpi("surface_worker.py", 2, layout, tmp_path, timeout=300)
    assert_ranks_ok(out, 2, f"SURFACE OK {layout}")
