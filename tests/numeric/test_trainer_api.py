"""Trainer contract: clear errors for bad input (before any work), IR dumps, compile cache."""
import numpy as np
import pytest
import torch

import raf_dist
from models import make


@pytest.fixture(scope="module")
def mlp_model():
    module, x, y = make("mlp", 8)
    return raf_dist.frontend.from_pytorch(module, (x,)), x.numpy(), y.numpy()


def test_unknown_loss_lists_allowed(mlp_model):
    with pytest.raises(ValueError, match=r"unknown loss 'hinge'.*cross_entropy.*mse"):
        raf_dist.Trainer(mlp_model[0], loss="hinge", optimizer=raf_dist.optim.SGD(lr=0.1))


def test_optimizer_required(mlp_model):
    with pytest.raises(TypeError, match="raf_dist.optim optimizer"):
        raf_dist.Trainer(mlp_model[0], optimizer=torch.optim.SGD)


@pytest.mark.parametrize("make_opt, message", [
    (lambda: raf_dist.optim.SGD(lr=-1), "lr must be >= 0"),
    (lambda: raf_dist.optim.SGD(lr=0.1, nesterov=True), "nesterov=True requires momentum"),
    (lambda: raf_dist.optim.Adam(betas=(1.0, 0.9)), r"betas\[0\] must be in \[0, 1\)"),
    (lambda: raf_dist.optim.AdamW(eps="small"), "eps must be a number"),
    (lambda: raf_dist.optim.Adam(betas=(0.9,)), "betas must be a pair"),
])
def test_bad_optimizer_arguments(make_opt, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_opt()


def test_optimizer_defaults_follow_torch():
    assert raf_dist.optim.AdamW(lr=1e-3).weight_decay == 0.01
    adam = raf_dist.optim.Adam(lr=1e-3)
    assert (adam.betas, adam.eps, adam.weight_decay) == ((0.9, 0.999), 1e-8, 0.0)


def test_step_input_mismatch_names_argument(mlp_model):
    model, x, y = mlp_model
    trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1))
    # any batch size is accepted (tests/numeric/test_batch_sizes.py), the rest as captured
    with pytest.raises(ValueError, match=r"input 0: expected shape \(8, 20\) and dtype float32.*got shape \(8, 19\)"):
        trainer.step(x[:, :19], y)
    with pytest.raises(ValueError, match=r"target: expected shape \(4,\) and dtype int64.*got shape \(8,\)"):
        trainer.step(x[:4], y)
    with pytest.raises(ValueError, match=r"target: expected shape \(8,\) and dtype int64.*dtype int32"):
        trainer.step(x, y.astype(np.int32))
    assert trainer.step_count == 0  # nothing ran


def test_unsupported_op_names_op_and_source():
    class Atan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.atan(self.lin(x))

    model = raf_dist.frontend.from_pytorch(Atan(), (torch.randn(2, 4),))
    with pytest.raises(NotImplementedError, match=r"torch Atan: no gradient is registered for relax.atan"):
        raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1))


def test_zero_without_data_parallel_is_refused(mlp_model, dist_config):
    dist_config.zero_opt_level = 1
    with pytest.raises(ValueError, match="requires enable_data_parallel=True"):
        raf_dist.Trainer(mlp_model[0], optimizer=raf_dist.optim.SGD(lr=0.1))


def test_ir_dump_and_compile_cache(mlp_model, tmp_path, monkeypatch):
    model, x, y = mlp_model
    monkeypatch.setenv("RAF_DIST_DUMP_IR", str(tmp_path / "ir"))
    cache = tmp_path / "cache"
    first = raf_dist.Trainer(model, optimizer=raf_dist.optim.Adam(lr=1e-3), cache_dir=cache)
    dumps = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert dumps[0].startswith("01_") and any("DispatchToBLAS" in d for d in dumps)
    assert any("StaticPlanBlockMemory" in d for d in dumps)
    assert "raf_dist.blas.matmul" in (tmp_path / "ir" / next(
        d for d in dumps if "DispatchToBLAS" in d)).read_text()
    assert not first.compiled.cache_hit
    second = raf_dist.Trainer(model, optimizer=raf_dist.optim.Adam(lr=1e-3), cache_dir=cache)
    assert second.compiled.cache_hit
    assert second.compiled.planned_peak_bytes == first.compiled.planned_peak_bytes
    assert first.step(x, y) == second.step(x, y)  # the cached artifact computes the same step
