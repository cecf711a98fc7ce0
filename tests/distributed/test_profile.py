"""Under `mpiexec -n 2` with data parallelism each rank's trace has its collectives — the
bucket's allreduce start and wait with the bucket's bytes, the loss allreduce — and the
timeline tool merges both ranks into one picture."""
import json

from mpi_launch import check_mpi
from raf_dist.tools import timeline

MLP_PARAMS = 20 * 32 + 32 + 32 * 32 + 32 + 32 * 5 + 5  # tests/models.py MLP((20, 32, 32, 5))


def test_each_rank_traces_its_collectives(tmp_path):
    check_mpi("profile_dp.py", 2, tmp_path, timeout=240)
    traces = timeline.load_traces(tmp_path)
    assert sorted(traces) == [0, 1]
    for rank, events in traces.items():
        assert all(e["pid"] == rank for e in events)
        assert sum(1 for e in events if e["cat"] == "step") == 2
        collectives = [e for e in events if e["cat"] == "collective"]
        by_op = {}
        for e in collectives:
            by_op.setdefault(e["args"]["op"], []).append(e["args"]["bytes"])
        # one gradient bucket (the default 25 MB holds them all), started early and waited
        # for late (overlap_comm), plus the loss; per step
        assert len(by_op["allreduce_start"]) == len(by_op["wait"]) == 2, by_op
        assert min(by_op["allreduce_start"]) >= 4 * MLP_PARAMS, by_op  # float32 gradients
        assert by_op["wait"] == by_op["allreduce_start"]
        assert by_op["allreduce"] == [4, 4]  # the mean loss, one float32
    summary = timeline.summary(traces)
    assert all(s["communication_ms"] > 0 and s["compute_ms"] > 0 for s in summary.values())
    png = tmp_path / "timeline.png"
    merged = tmp_path / "merged.json"
    assert timeline.main([str(tmp_path), "-o", str(png), "--merged", str(merged)]) == 0
    assert png.stat().st_size > 0
    assert {e["pid"] for e in json.loads(merged.read_text())["traceEvents"]} == {0, 1}
