"""Models written with raf_dist.nn (TVM's relax.frontend.nn) train through the same Trainer
path as imported ones: the same MLP, given the same initial weights, matches PyTorch."""
import numpy as np
import torch

import raf_dist
from raf_dist import nn


class MLP(nn.Module):
    def __init__(self):
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(nn.relu(self.fc1(x)))


def test_relax_nn_mlp_matches_pytorch():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    init = {"fc1.weight": ref[0].weight, "fc1.bias": ref[0].bias,
            "fc2.weight": ref[2].weight, "fc2.bias": ref[2].bias}
    init = {k: v.detach().numpy().copy() for k, v in init.items()}
    model = raf_dist.frontend.from_relax_nn(MLP(), [((5, 6), "float32")], init_params=init)
    assert model.param_names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    trainer = raf_dist.Trainer(model, loss="cross_entropy",
                               optimizer=raf_dist.optim.SGD(lr=0.1, momentum=0.9))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)
    for _ in range(4):
        loss = trainer.step(x.numpy(), y.numpy())
        opt.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        opt.step()
        assert abs(loss - ref_loss.item()) <= 2e-5 * abs(ref_loss.item())
    got = trainer.state_dict()
    np.testing.assert_allclose(got["fc1.weight"], ref[0].weight.detach().numpy(), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got["fc2.bias"], ref[2].bias.detach().numpy(), rtol=2e-5, atol=1e-6)


def test_relax_nn_default_init_is_seeded():
    a = raf_dist.frontend.from_relax_nn(MLP(), [((5, 6), "float32")], seed=3)
    b = raf_dist.frontend.from_relax_nn(MLP(), [((5, 6), "float32")], seed=3)
    for name in a.param_names:
        np.testing.assert_array_equal(a.init_params[name], b.init_params[name])
    bound = 1 / np.sqrt(6)
    assert np.abs(a.init_params["fc1.weight"]).max() <= bound
