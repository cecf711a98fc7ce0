"""Checkpoints in one process: exact resume, atomicity against a save that dies half way,
clear errors for damaged or foreign checkpoints (with the files left untouched), and the
consolidated file loaded into PyTorch. The distributed tier covers resharding."""
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import raf_dist
from models import make, raf_optimizer
from raf_dist import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]


def _trainer(name="mlp", optimizer="adamw", batch=8, seed=0):
    module, x, y = make(name, batch, seed=seed)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_optimizer(optimizer))
    return trainer, module, x.numpy(), y.numpy()


def _tree_digest(path):
    digest = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        digest.update(str(p.relative_to(path)).encode())
        if p.is_file():
            digest.update(p.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("level", [0, 2, 3])
def test_resume_is_bitwise_exact(tmp_path, dist_config, level):
    dist_config.update({"enable_data_parallel": level > 0, "zero_opt_level": level})
    trainer, _, x, y = _trainer()
    for _ in range(3):
        trainer.step(x, y)
    trainer.save_checkpoint(tmp_path, extra={"epoch": 1, "batch": 3})
    uninterrupted = [trainer.step(x, y) for _ in range(3)]
    expected = trainer.state_dict()
    expected_states = trainer.optimizer_state_dict()

    resumed, _, _, _ = _trainer(seed=5)  # different initial parameters: all come from disk
    assert resumed.load_checkpoint(tmp_path) == {"epoch": 1, "batch": 3}
    assert resumed.step_count == 3
    assert [resumed.step(x, y) for _ in range(3)] == uninterrupted
    for key, value in resumed.state_dict().items():
        np.testing.assert_array_equal(value, expected[key])
    for key, states in resumed.optimizer_state_dict().items():
        for state, value in states.items():
            np.testing.assert_array_equal(value, expected_states[key][state])


def test_a_save_that_dies_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer, _, x, y = _trainer()
    trainer.step(x, y)
    first = trainer.save_checkpoint(tmp_path)
    saved = trainer.state_dict()
    trainer.step(x, y)

    def die(*args, **kwargs):  # the process dies after its shard is written, before rename
        raise SystemExit("killed during save")

    monkeypatch.setattr(ckpt.files, "finalize", die)
    with pytest.raises(SystemExit):
        trainer.save_checkpoint(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text().strip() == first.name
    assert list(tmp_path.glob(".tmp-step-*"))  # the half-written one is there, ignored
    fresh, _, _, _ = _trainer(seed=3)
    fresh.load_checkpoint(tmp_path)
    for key, value in fresh.state_dict().items():
        np.testing.assert_array_equal(value, saved[key])
    trainer.save_checkpoint(tmp_path)  # the next good save cleans the stale directory up
    assert not list(tmp_path.glob(".tmp-step-*"))


def test_keep_bounds_the_number_of_checkpoints(tmp_path):
    trainer, _, x, y = _trainer()
    for _ in range(4):
        trainer.step(x, y)
        trainer.save_checkpoint(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated"),
    ("flip", "corrupted"),
    ("delete", "missing"),
    ("meta", "meta.json is corrupted"),
])
def test_damaged_checkpoint_is_refused_and_left_alone(tmp_path, damage, message):
    trainer, _, x, y = _trainer()
    trainer.step(x, y)
    directory = trainer.save_checkpoint(tmp_path)
    shard = directory / "rank00000.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-16])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (directory / "meta.json").write_text("{ not json")
    before = _tree_digest(tmp_path)
    params = trainer.state_dict()
    with pytest.raises(ckpt.CheckpointError, match=message):
        trainer.load_checkpoint(tmp_path)
    assert _tree_digest(tmp_path) == before
    for key, value in trainer.state_dict().items():  # the trainer is unchanged too
        np.testing.assert_array_equal(value, params[key])


def test_checkpoint_of_another_model_is_refused(tmp_path):
    cnn, _, x, y = _trainer("cnn")
    cnn.save_checkpoint(tmp_path)
    mlp, _, _, _ = _trainer("mlp")
    with pytest.raises(ckpt.CheckpointError, match="different model"):
        mlp.load_checkpoint(tmp_path)
    sgd, _, _, _ = _trainer("cnn", optimizer="sgd_momentum")
    with pytest.raises(ckpt.CheckpointError, match="momentum_buffer"):
        sgd.load_checkpoint(tmp_path)


def test_row_wise_state_resumes_and_is_not_taken_for_adagrads(tmp_path):
    """Row-wise Adagrad's (rows, 1) accumulators save and resume bitwise; plain Adagrad keeps
    a state of the same name shaped like the parameter, and its load is refused, naming it."""
    rows, _, x, y = _trainer("cnn", optimizer="rowwise_adagrad")
    rows.step(x, y)
    rows.save_checkpoint(tmp_path)
    expected = [rows.step(x, y) for _ in range(2)]
    resumed, _, _, _ = _trainer("cnn", optimizer="rowwise_adagrad")
    resumed.load_checkpoint(tmp_path)
    assert [resumed.step(x, y) for _ in range(2)] == expected
    for key, value in rows.optimizer_state_dict().items():
        np.testing.assert_array_equal(resumed.optimizer_state_dict()[key]["sum"], value["sum"])
    plain, _, _, _ = _trainer("cnn", optimizer="adagrad")
    with pytest.raises(ckpt.CheckpointError, match="one value per row"):
        plain.load_checkpoint(tmp_path)


def test_no_checkpoint_names_the_path(tmp_path):
    trainer, _, _, _ = _trainer()
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint in"):
        trainer.load_checkpoint(tmp_path / "nothing")


def test_consolidated_parameters_load_into_pytorch(tmp_path):
    from safetensors.torch import load_file

    trainer, module, x, y = _trainer("cnn")
    for _ in range(2):
        trainer.step(x, y)
    trainer.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "model.safetensors"
    proc = subprocess.run([sys.executable, "-m", "raf_dist.tools.consolidate",
                           str(tmp_path / "ckpt"), str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    module.load_state_dict(load_file(str(out)))  # names are named_parameters()'
    with torch.no_grad():
        logits = module.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(logits, trainer.predict(x), rtol=1e-5, atol=1e-5)


def test_consolidate_refuses_a_damaged_checkpoint(tmp_path):
    trainer, _, x, y = _trainer()
    directory = trainer.save_checkpoint(tmp_path / "ckpt")
    shard = directory / "rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    proc = subprocess.run([sys.executable, "-m", "raf_dist.tools.consolidate",
                           str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "truncated" in proc.stderr
    assert not (tmp_path / "out.safetensors").exists()


# ---- reliability (issue #18) --------------------------------------------------------------
def test_saving_a_step_again_killed_anywhere_leaves_latest_loadable(tmp_path, monkeypatch):
    """A second save of the same step replaces the first without a moment in which ``latest``
    names a missing or partial directory: the save is killed after each of its file-system
    changes in turn (rename, replace, delete), and the checkpoint still loads."""
    import os
    import shutil

    trainer, _, x, y = _trainer()
    trainer.step(x, y)
    trainer.save_checkpoint(tmp_path)
    saved = trainer.state_dict()
    real = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree}
    for kill_after in range(6):
        calls = []

        def counted(name):
            def call(*args, **kwargs):
                if str(tmp_path) in str(args[0]):
                    if len(calls) == kill_after:
                        raise SystemExit(f"killed before {name} {args[0]}")
                    calls.append(name)
                return real[name](*args, **kwargs)
            return call

        monkeypatch.setattr(os, "rename", counted("rename"))
        monkeypatch.setattr(os, "replace", counted("replace"))
        monkeypatch.setattr(shutil, "rmtree", counted("rmtree"))
        try:
            trainer.save_checkpoint(tmp_path)  # step 1 again
        except SystemExit:
            pass
        monkeypatch.undo()
        fresh, _, _, _ = _trainer(seed=3)
        fresh.load_checkpoint(tmp_path)
        for key, value in fresh.state_dict().items():
            np.testing.assert_array_equal(value, saved[key])
    trainer.save_checkpoint(tmp_path)  # a complete one: one copy of step 1 is left
    assert [p.name for p in tmp_path.glob("step-*")] == [(tmp_path / "latest").read_text().strip()]


def test_pruning_goes_by_step_number_and_spares_latest(tmp_path):
    trainer, _, x, y = _trainer()
    trainer.step(x, y)
    for step in (99_999_999, 100_000_000, 100_000_001):  # 9 digits sort before 8 by name
        trainer.step_count = step
        trainer.save_checkpoint(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-100000000", "step-100000001"]
    trainer.step_count = 5  # an older step saved last (a resumed run): latest, never pruned
    trainer.save_checkpoint(tmp_path, keep=1)
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000005", "step-100000001"]


def test_the_sweep_spares_another_jobs_save_in_progress(tmp_path):
    import os
    import time

    trainer, _, x, y = _trainer()
    trainer.step(x, y)
    trainer.save_checkpoint(tmp_path)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        host = ckpt.host_tag()
        in_progress = tmp_path / f".tmp-step-00000009.{host}.{alive.pid}.ab12"
        elsewhere = tmp_path / ".tmp-step-00000009.otherhost.1.ab12"
        killed = tmp_path / f".tmp-step-00000009.{host}.{dead.pid}.ab12"
        ancient = tmp_path / ".tmp-step-00000002"  # no owner in its name: only age tells
        for d in (in_progress, elsewhere, killed, ancient):
            d.mkdir()
        old = time.time() - ckpt.STALE_TMP_SECONDS - 60
        os.utime(ancient, (old, old))
        trainer.step(x, y)
        trainer.save_checkpoint(tmp_path)
        assert in_progress.is_dir() and elsewhere.is_dir()
        assert not killed.exists() and not ancient.exists()
    finally:
        alive.kill()
        alive.wait()


def test_load_opens_each_file_once(tmp_path, monkeypatch):
    import safetensors

    trainer, _, x, y = _trainer()
    trainer.step(x, y)
    trainer.save_checkpoint(tmp_path)
    opened = []
    real_open = safetensors.safe_open

    def counting_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting_open)
    trainer.load_checkpoint(tmp_path)
    assert opened == ["rank00000.safetensors"]


def test_the_activity_names_the_running_step_and_the_last_completed(tmp_path):
    trainer, _, x, y = _trainer()
    seen = []
    step_fn = trainer.executor._step_fn

    def watching(*args):
        seen.append(trainer.comm.activity)
        return step_fn(*args)

    trainer.executor._step_fn = watching
    trainer.step(x, y)
    trainer.step(x, y)
    assert seen == ["step 1 (last completed: 0)", "step 2 (last completed: 1)"]
    assert trainer.comm.activity == "work between steps (last completed: 2)"
