"""Gradient accumulation (num_microbatches = M at pipeline_parallel_size = 1): M microbatches,
one update, equal to one step on the whole batch (the microbatch losses weighted by rows, so
uneven microbatches and a batch with fewer rows than M are exact too). The distributed tier
runs it under data and tensor parallelism (tests/distributed/test_tensor_parallel.py)."""
import pytest

import raf_dist
from models import make, raf_optimizer, rel_err


def train(config, name, optimizer, microbatches, batches):
    """``config``: the test's dist_config fixture (tests/conftest.py)."""
    config.num_microbatches = microbatches
    module, x, y = make(name, 8)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_optimizer(optimizer))
    per_row = len(y) // len(x)  # target rows per input row (flat_lm: seq)
    losses = [trainer.step(x.numpy()[:rows], y.numpy()[:rows * per_row]) for rows in batches]
    return losses, trainer


@pytest.mark.parametrize("name,optimizer,microbatches,batches", [
    ("mlp", "sgd_momentum", 3, [8, 8, 6]),  # 8 rows as 3 + 3 + 2; then another batch size
    ("mlp", "adam", 2, [8, 7]),
    # targets of batch * seq rows (nanoGPT's flattened logits): each microbatch its share,
    # at another batch size than the captured 8 and split unevenly (3 + 2 rows)
    ("flat_lm", "adamw", 2, [5])])
def test_microbatches_equal_one_step_on_the_whole_batch(dist_config, name, optimizer,
                                                         microbatches, batches):
    ref_losses, ref = train(dist_config, name, optimizer, 1, batches)
    losses, trainer = train(dist_config, name, optimizer, microbatches, batches)
    assert rel_err(losses, ref_losses) <= 1e-6, (losses, ref_losses)
    params, ref_params = trainer.state_dict(), ref.state_dict()
    for key, value in ref_params.items():
        assert rel_err(params[key], value) <= 1e-6, (key, rel_err(params[key], value))
    states, ref_states = trainer.optimizer_state_dict(), ref.optimizer_state_dict()
    for key, by_state in ref_states.items():
        for state, value in by_state.items():
            assert rel_err(states[key][state], value) <= 1e-5, (key, state)
    kinds = {key[1] for key in trainer.executor._variants if isinstance(key, tuple)}
    assert kinds == {"partial", "final"}, trainer.executor._variants.keys()


def test_fewer_rows_than_microbatches_still_one_exact_step(dist_config):
    ref_losses, ref = train(dist_config, "mlp", "adamw", 1, [2, 3])
    # 2 and 3 microbatches of one row
    losses, trainer = train(dist_config, "mlp", "adamw", 4, [2, 3])
    assert rel_err(losses, ref_losses) <= 1e-6
    for key, value in ref.state_dict().items():
        assert rel_err(trainer.state_dict()[key], value) <= 1e-6, key


def test_a_target_that_does_not_follow_the_batch_is_refused_under_microbatches(dist_config):
    """The target's leading dimension (3) is no multiple of the input's rows (4): no
    microbatch can carry a share of it; refused when the Trainer is built."""
    import torch

    class Pooled(torch.nn.Module):  # the batch pooled away: 3 outputs whatever the rows
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(20, 3)

        def forward(self, x):
            return self.fc(x).sum(0)

    dist_config.num_microbatches = 2
    model = raf_dist.frontend.from_pytorch(Pooled(), (torch.randn(4, 20),))
    with pytest.raises(ValueError, match="does not follow the batch"):
        raf_dist.Trainer(model, loss="mse", optimizer=raf_optimizer("adamw"))


def test_zero3_with_microbatches_is_refused_before_anything_runs(dist_config):
    dist_config.update({"enable_data_parallel": True, "zero_opt_level": 3, "num_microbatches": 2})
    module, x, _ = make("mlp", 4)
    with pytest.raises(ValueError, match="num_microbatches=2 with zero_opt_level=3"):
        raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                         optimizer=raf_optimizer("adamw"))
