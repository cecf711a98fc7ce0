"""Numeric tier for mixed precision (Trainer(precision="bf16")) against PyTorch's own
``torch.autocast("cpu", dtype=torch.bfloat16)`` on the same data.

bf16 results cannot match PyTorch's bit for bit: the two round at different points (PyTorch's
autocast keeps the elementwise work and the residual stream in float32, raf_dist computes it
in bf16). The tolerance is calibrated per case from PyTorch itself: raf_dist's bf16 losses
and parameters must be as close to the float32 run as PyTorch's autocast run is, within
TOL_FACTOR (measured: 1.5-1.9x, as raf_dist also rounds the elementwise work), so a verdict
is a statement about bf16's rounding on that case, not a constant that one machine happens
to satisfy. A run that silently stayed in
float32 is caught separately: its step IR must hold bfloat16 matmuls."""
import numpy as np
import pytest

import raf_dist
from models import make, raf_optimizer, rel_err, torch_reference

STEPS = 5
TOL_FACTOR = 3.0


def distance(losses, params, ref_losses, ref_params):
    return max([rel_err(losses, ref_losses)]
               + [rel_err(params[k], ref_params[k]) for k in ref_params])


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_bf16_as_close_to_fp32_as_torch_autocast(name):
    import torch

    module, x, y = make(name, 8)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_optimizer("adamw"), precision="bf16")
    assert 'dtype="bfloat16") = R.matmul(' in trainer.executor.ir.script()
    losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(STEPS)]
    params = trainer.state_dict()
    assert all(v.dtype == np.float32 for v in params.values())  # master weights
    assert all(s.dtype == np.float32 for d in trainer.optimizer_state_dict().values()
               for s in d.values())
    fp32_losses, fp32_params = torch_reference(name, "adamw", 8, STEPS)
    amp_losses, amp_params = torch_reference(name, "adamw", 8, STEPS, autocast=torch.bfloat16)
    ours = distance(losses, params, fp32_losses, fp32_params)
    theirs = distance(amp_losses, amp_params, fp32_losses, fp32_params)
    assert ours > 0  # something was computed in bf16
    print(f"{name}: raf_dist bf16 {ours:.2e}, torch autocast {theirs:.2e} from float32")
    assert ours <= TOL_FACTOR * theirs, (ours, theirs)
    # predict computes as the training forward does (bf16), close to float32's outputs
    out = trainer.predict(x.numpy())
    assert out.dtype == np.float32 and out.shape[0] == 8


def test_bad_precision_names_the_allowed_values():
    module, x, _ = make("mlp", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'bf16', 'fp16'\)"):
        raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), precision="bfloat16")
    with pytest.raises(ValueError, match=r"grad_reduce_dtype must be one of"):
        raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), grad_reduce_dtype="fp16")
    with pytest.raises(NotImplementedError, match=r"precision='fp16' needs dynamic loss"):
        raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), precision="fp16")


def test_bf16_checkpoint_resumes_bitwise(tmp_path):
    """float32 masters in the checkpoint: a resumed bf16 run continues exactly."""
    module, x, y = make("mlp", 8)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    first = raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), precision="bf16")
    for _ in range(2):
        first.step(x.numpy(), y.numpy())
    first.save_checkpoint(tmp_path)
    expected = [first.step(x.numpy(), y.numpy()) for _ in range(2)]
    second = raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), precision="bf16")
    second.load_checkpoint(tmp_path)
    assert [second.step(x.numpy(), y.numpy()) for _ in range(2)] == expected
    for k, v in first.state_dict().items():
        assert np.array_equal(second.state_dict()[k], v)
