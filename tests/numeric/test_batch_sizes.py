"""Any batch size at step time (training/batch_size.py): a model captured with 8 rows trains
on 8, 5 and 1 rows as PyTorch does, one compiled step per size (cached, sharing parameters
and optimizer state), dropout masks and predict follow the batch size; bad batches raise.
The distributed half (uneven batches over ranks): tests/distributed/test_uneven_batch.py."""
import dataclasses
import importlib
import logging

import numpy as np
import pytest
import torch

import raf_dist
from models import make, make_sharded_rec, raf_optimizer, rel_err, torch_optimizer

# float32 sums in another order per step: ~1e-7 each; a few steps stay far below 1e-5
TOL = 1e-5
SIZES = (8, 5, 1, 5, 8)  # new sizes, a repeated one, back to the captured one


def _rows(x, y, rows, offset):
    index = (np.arange(rows) + offset) % len(x)
    return x[index], y[index]


def test_sizes_8_5_1_match_pytorch_one_step_per_size(tmp_path, monkeypatch, caplog):
    module, x, y = make("mlp", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    compiles = []
    trainer_module = importlib.import_module("raf_dist.runtime.spmd_build")
    real_compile = trainer_module.compile_step

    def counting_compile(*args, **kwargs):
        compiles.append(1)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "compile_step", counting_compile)
    cache = tmp_path / "cache"
    trainer = raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), cache_dir=cache)
    assert len(compiles) == 1 and trainer.compiled_batch_sizes == [8]
    data_x, data_y = make("mlp", 16, seed=5)[1:]
    opt = torch_optimizer("adamw", module.parameters())
    with caplog.at_level(logging.INFO, logger="raf_dist"):
        for step, rows in enumerate(SIZES):
            xb, yb = _rows(data_x, data_y, rows, offset=3 * step)
            loss = trainer.step(xb.numpy(), yb.numpy())
            opt.zero_grad()
            ref = torch.nn.functional.cross_entropy(module(xb), yb)
            ref.backward()
            opt.step()
            assert abs(loss - ref.item()) <= TOL * abs(ref.item()), (rows, loss, ref.item())
    params = trainer.state_dict()
    for name, p in module.named_parameters():
        assert rel_err(params[name], p.detach().numpy()) <= TOL, name
    # one compile per new size, none for a size seen before; logged once per new size
    assert trainer.compiled_batch_sizes == [1, 5, 8]
    assert len(compiles) == 3
    logged = [r for r in caplog.records if "compiling a step for this size" in r.getMessage()]
    assert len(logged) == 2
    # every size's step was built here, and a second Trainer finds them all in the cache
    assert not any(v.compiled.cache_hit for v in trainer.executor._variants.values())
    again = raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), cache_dir=cache)
    again.step(*(a.numpy() for a in _rows(data_x, data_y, 5, 0)))
    assert again.executor._variants[5].compiled.cache_hit and again.compiled.cache_hit


def test_predict_on_any_number_of_rows():
    module, x, y = make("mlp", 8)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_optimizer("sgd_momentum"))
    trainer.step(x.numpy(), y.numpy())
    module.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.state_dict().items()})
    data = make("mlp", 21, seed=9)[1]
    for rows in (1, 3, 8, 21):  # under, at and over the captured batch (8 + 8 + 5)
        expected = module(data[:rows]).detach().numpy()
        np.testing.assert_allclose(trainer.predict(data[:rows].numpy()), expected, rtol=1e-5,
                                   atol=1e-6)
    assert trainer.executor._forwards.sizes() == [1, 3, 5, 8]  # one forward per piece size
    # a single-input model takes a list of rows, or its one input wrapped in a tuple
    np.testing.assert_allclose(trainer.predict([data[0].numpy(), data[1].numpy()]),
                               module(data[:2]).detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trainer.predict((data[:3].numpy(),)),
                               module(data[:3]).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_predict_takes_every_input_of_a_multi_input_model():
    """A recommender's four inputs (dense features, bags of ids, a category, per-sample
    weights) cut together into pieces; the last piece padded with copies of the first row
    when the model cannot be captured again (its padded outputs cut off)."""
    module, x, y = make_sharded_rec(4)
    model = raf_dist.frontend.from_pytorch(module, x)
    trainer = raf_dist.Trainer(model, optimizer=raf_optimizer("sgd"), local=True)
    trainer.step([a.numpy() for a in x], y.numpy())
    module.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.state_dict().items()})
    data = make_sharded_rec(11, seed=5)[1]
    expected = module(*data).detach().numpy()
    np.testing.assert_allclose(trainer.predict(tuple(a.numpy() for a in data)), expected,
                               rtol=1e-5, atol=1e-6)
    assert trainer.executor._forwards.sizes() == [3, 4]
    fixed = raf_dist.Trainer(dataclasses.replace(raf_dist.frontend.from_pytorch(module, x),
                                                 respecialize=None),
                             optimizer=raf_optimizer("sgd"), local=True)  # the trained values
    np.testing.assert_allclose(fixed.predict(tuple(a.numpy() for a in data)), expected,
                               rtol=1e-5, atol=1e-6)
    assert fixed.executor._forwards.sizes() == [4]
    with pytest.raises(ValueError, match=r"input 1: rows must have shape \(3, 4\)"):
        trainer.predict([data[0].numpy(), data[1][:, :2].numpy(), data[2].numpy(),
                         data[3].numpy()])
    with pytest.raises(ValueError, match="got 1 input"):
        trainer.predict(data[0].numpy())


def test_dropout_masks_follow_the_batch_size():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                 torch.nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.SGD(lr=0.1), seed=3)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    drop = module[2]
    for step, rows in enumerate((6, 3), start=1):
        masks = trainer.dropout_masks(step, rows)  # captures the 3-row model before any hook
        assert masks[0].shape == (rows, 16)
        hook = drop.register_forward_hook(lambda mod, inp, out, m=torch.tensor(masks[0]):
                                          inp[0] * m)
        loss = trainer.step(x[:rows].numpy(), y[:rows].numpy())
        opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(module(x[:rows]), y[:rows])
        ref.backward()
        opt.step()
        hook.remove()
        assert abs(loss - ref.item()) <= TOL * abs(ref.item())
    for name, p in module.named_parameters():
        assert rel_err(trainer.state_dict()[name], p.detach().numpy()) <= TOL, name


def test_batch_norm_statistics_follow_the_batch_size():
    module, x, y = make("bn_mlp", 8)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.SGD(lr=0.1))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    module.train()
    for rows in (8, 5):
        loss = trainer.step(x[:rows].numpy(), y[:rows].numpy())
        opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(module(x[:rows]), y[:rows])
        ref.backward()
        opt.step()
        assert abs(loss - ref.item()) <= TOL * abs(ref.item())
    buffers = trainer.buffers_dict()
    for name, b in module.named_buffers():
        np.testing.assert_allclose(buffers[name], b.numpy(), rtol=TOL, atol=1e-6, err_msg=name)
    for name, p in module.named_parameters():
        assert rel_err(trainer.state_dict()[name], p.detach().numpy()) <= TOL, name


def test_bad_batches_raise_before_any_work():
    module, x, y = make("mlp", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match="got no rows"):
        trainer.step(x[:0].numpy(), y[:0].numpy())
    with pytest.raises(ValueError, match=r"target: expected shape \(5,\)"):
        trainer.step(x[:5].numpy(), y.numpy())
    with pytest.raises(ValueError, match=r"input 0: expected shape \(3, 20\).*\(3, 19\)"):
        trainer.step(x[:3, :19].numpy(), y[:3].numpy())
    assert trainer.step_count == 0 and trainer.compiled_batch_sizes == [8]
    fixed = raf_dist.Trainer(dataclasses.replace(model, respecialize=None),
                             optimizer=raf_dist.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match="cannot be captured again at 4 rows"):
        fixed.step(x[:4].numpy(), y[:4].numpy())
    assert fixed.step(x.numpy(), y.numpy()) > 0  # the captured size still trains


def test_relax_nn_model_takes_any_batch_size():
    """A raf_dist.nn model is exported again with the new leading dimension."""
    from raf_dist import nn

    class MLP(nn.Module):
        def __init__(self):
            self.fc1 = nn.Linear(6, 8)
            self.fc2 = nn.Linear(8, 3)

        def forward(self, x):
            return self.fc2(nn.relu(self.fc1(x)))

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    init = {f"fc{i}.{k}": getattr(ref[j], k).detach().numpy().copy()
            for i, j in ((1, 0), (2, 2)) for k in ("weight", "bias")}
    model = raf_dist.frontend.from_relax_nn(MLP(), [((5, 6), "float32")], init_params=init)
    trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.SGD(lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)
    for rows in (5, 2):
        loss = trainer.step(x[:rows].numpy(), y[:rows].numpy())
        opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(ref(x[:rows]), y[:rows])
        ref_loss.backward()
        opt.step()
        assert abs(loss - ref_loss.item()) <= TOL * abs(ref_loss.item())
    assert trainer.compiled_batch_sizes == [2, 5]
    np.testing.assert_allclose(trainer.state_dict()["fc1.weight"], ref[0].weight.detach().numpy(),
                               rtol=TOL, atol=1e-6)
