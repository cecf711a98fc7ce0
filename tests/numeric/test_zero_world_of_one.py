"""ZeRO in a world of one (a debugging run: every shard is the whole tensor, held flat): each
level trains exactly like the plain Trainer, and state_dict / optimizer_state_dict / predict
see true shapes."""
import numpy as np
import pytest

from models import train_zero


def _run(level, name="cnn", steps=3):
    losses, trainer, x = train_zero(name, 6, level, steps)
    return (losses, trainer.state_dict(), trainer.optimizer_state_dict(),
            trainer.predict(x.numpy()), trainer)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_every_level_equals_the_plain_trainer(level):
    losses, params, states, logits, trainer = _run(level)
    ref_losses, ref_params, ref_states, ref_logits, _ = _run(0)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for key, value in ref_params.items():
        assert params[key].shape == value.shape
        np.testing.assert_allclose(params[key], value, rtol=1e-5, atol=1e-7)
    for key, by_state in ref_states.items():
        for state, value in by_state.items():
            np.testing.assert_allclose(states[key][state], value, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
    assert trainer.num_grad_buckets >= 2
    if level == 3:  # parameters are held flat
        assert all(len(p.shape) == 1 for p in trainer.executor._params)
