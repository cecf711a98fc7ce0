"""Trainer.profile / RAF_DIST_PROFILE write a Chrome trace (Trace Event Format) of the steps
they record, and raf_dist.tools.timeline summarises and draws it (one process; the collective
events under data parallelism: tests/distributed/test_profile.py)."""
import json

import numpy as np
import pytest

import raf_dist
from models import make
from raf_dist.tools import timeline

_REQUIRED = {"name", "cat", "ph", "ts", "dur", "pid", "tid"}


def _trainer(name):
    module, x, y = make(name, 8)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.Adam(lr=1e-3))
    return trainer, x.numpy(), y.numpy()


def _complete(path):
    trace = json.loads(path.read_text())  # valid JSON, or this raises
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_profile_records_steps_kernels_and_blas_then_stops(tmp_path):
    trainer, x, y = _trainer("transformer")  # embedding, matmuls (BLAS), softmax, layer norm
    path = trainer.profile(2, tmp_path)
    assert path == str(tmp_path / "trace-rank0.json")
    losses = [trainer.step(x, y) for _ in range(3)]  # the third is not recorded
    events = _complete(tmp_path / "trace-rank0.json")
    assert all(_REQUIRED <= set(e) and e["pid"] == 0 and e["dur"] >= 0 for e in events)
    steps = [e for e in events if e["cat"] == "step"]
    assert [e["name"] for e in steps] == ["step 1", "step 2"]
    kernels = [e for e in events if e["cat"] == "kernel"]
    blas = [e for e in events if e["cat"] == "blas"]
    assert "take_backward" in {e["name"] for e in kernels}  # the embedding gradient
    assert blas and all(e["name"] == "raf_dist.blas.matmul" and len(e["args"]["shapes"]) == 3
                        for e in blas)
    # with each call's transpose flags, as the extraction names the shape (Event.gemms):
    # the backward's folded transposes among them
    assert all(e["args"]["trans"] in ([0, 0], [0, 1], [1, 0], [1, 1]) for e in blas)
    assert any(1 in e["args"]["trans"] for e in blas)
    for e in kernels + blas:  # every call lies inside one of the recorded steps
        assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]
                   for s in steps), e
    # each step runs the same calls: the two steps recorded the same number of kernels
    per_step = [sum(1 for e in kernels if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]) for s in steps]
    assert per_step[0] == per_step[1] > 0
    assert np.isfinite(losses).all()

    # the profiler removed its instrument: profiling again records only the new steps
    trainer.profile(1, tmp_path / "again")
    trainer.step(x, y)
    assert [e["name"] for e in _complete(tmp_path / "again" / "trace-rank0.json")
            if e["cat"] == "step"] == ["step 4"]

    png = tmp_path / "timeline.png"
    assert timeline.main([str(tmp_path), "-o", str(png), "--top", "5", "--skip", "1"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    traces = timeline.load_traces(tmp_path)
    rows = timeline.top_calls(traces, 5)
    assert len(rows) == 5 and rows[0]["total_ms"] >= rows[-1]["total_ms"] > 0
    later = timeline.skip_steps(traces, 1)[0]
    assert [e["name"] for e in later if e["cat"] == "step"] == ["step 2"]
    assert sum(1 for e in later if e["cat"] == "kernel") == per_step[1]
    with pytest.raises(ValueError, match="recorded 2 steps: cannot skip 2"):
        timeline.skip_steps(traces, 2)


def test_environment_variable_profiles_the_first_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("RAF_DIST_PROFILE", str(tmp_path))
    monkeypatch.setenv("RAF_DIST_PROFILE_STEPS", "1")
    trainer, x, y = _trainer("mlp")
    trainer.step(x, y)
    events = _complete(tmp_path / "trace-rank0.json")
    assert [e["name"] for e in events if e["cat"] == "step"] == ["step 1"]
    monkeypatch.setenv("RAF_DIST_PROFILE_STEPS", "0")
    with pytest.raises(ValueError, match="RAF_DIST_PROFILE_STEPS='0': give a positive number"):
        _trainer("mlp")


def test_timeline_names_the_fix_for_an_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="trainer.profile"):
        timeline.load_traces(tmp_path)
