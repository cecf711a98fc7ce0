"""A CPU step is compiled in a forked build process (raf_dist.compiler.build._build_in_child):
the library comes back through the cache and computes the same; the compiler's failures
arrive in this process as they were raised there; a build process that dies is named; and
RAF_DIST_BUILD_IN_PROCESS=1 compiles here."""
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from raf_dist.compiler import build
from raf_dist.compiler.schedule import ScheduleFallbackError


@I.ir_module
class Affine:
    @R.function
    def main(x: R.Tensor((16, 8), "float32"), w: R.Tensor((8, 4), "float32")):
        with R.dataflow():
            z = R.nn.relu(R.matmul(x, w))
            R.output(z)
        return z


def _planning_pid(monkeypatch, tmp_path, then=None):
    """Make the build record the pid that plans it (into a file: the child's memory is its
    own), then do ``then`` there."""
    record, plan = tmp_path / "pid", build.lower_and_plan

    def recording(*args, **kwargs):
        record.write_text(str(os.getpid()))
        if then is not None:
            then()
        return plan(*args, **kwargs)

    monkeypatch.setattr(build, "lower_and_plan", recording)
    return record


def test_the_step_is_built_in_another_process_and_computes_the_same(monkeypatch, tmp_path):
    monkeypatch.delenv("RAF_DIST_BUILD_IN_PROCESS", raising=False)
    record = _planning_pid(monkeypatch, tmp_path)
    step = build.compile_step(Affine, cache_dir=tmp_path / "cache")
    assert int(record.read_text()) != os.getpid()
    assert not step.cache_hit and Path(step.cache_path).exists()  # what the child wrote
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((16, 8), "float32"), rng.standard_normal((8, 4), "float32")
    out = relax.VirtualMachine(step.executable, tvm.cpu())["main"](
        tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    np.testing.assert_allclose(out, np.maximum(x @ w, 0), rtol=1e-5, atol=1e-6)
    assert step.planned_peak_bytes == build.compile_step(
        Affine, cache_dir=tmp_path / "cache").planned_peak_bytes


def test_the_switch_builds_in_this_process(monkeypatch, tmp_path):
    monkeypatch.setenv("RAF_DIST_BUILD_IN_PROCESS", "1")
    record = _planning_pid(monkeypatch, tmp_path)
    build.compile_step(Affine, cache_dir=tmp_path / "cache")
    assert int(record.read_text()) == os.getpid()


def test_a_compiler_error_is_raised_here_as_it_was_raised_there(monkeypatch, tmp_path):
    monkeypatch.delenv("RAF_DIST_BUILD_IN_PROCESS", raising=False)

    def fail():
        raise ScheduleFallbackError("kernel 'sum' left unscheduled (strict)")

    _planning_pid(monkeypatch, tmp_path, fail)
    with pytest.raises(ScheduleFallbackError, match="left unscheduled") as raised:
        build.compile_step(Affine, cache_dir=tmp_path / "cache")
    assert "in the build process" in str(raised.value.__cause__)
    assert not list((tmp_path / "cache").glob("step-*.so"))


def test_a_build_process_that_dies_is_named(monkeypatch, tmp_path):
    monkeypatch.delenv("RAF_DIST_BUILD_IN_PROCESS", raising=False)
    _planning_pid(monkeypatch, tmp_path, lambda: os.kill(os.getpid(), signal.SIGKILL))
    with pytest.raises(RuntimeError, match="killed by signal 9 .*RAF_DIST_BUILD_IN_PROCESS=1"):
        build.compile_step(Affine, cache_dir=tmp_path / "cache")
