"""Numeric tier: the operators real models need, each imported with ``from_pytorch`` and
trained one SGD step against PyTorch autograd (loss and every parameter after the step, i.e.
the gradients). One tiny module per operator: compile time dominates, so shapes stay small.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import raf_dist
from models import rel_err

LR = 0.5  # large enough that a wrong gradient moves the parameters visibly
# float32 with a different reduction order: ~1e-7 per op; 1e-5 leaves room for the deepest
# case (MultiheadAttention: projections, softmax, matmuls) without hiding a wrong gradient
TOL = 1e-5
# the update p_after - p_before = -LR * grad, compared directly (measured: <= 4e-7 on every
# case; it is recovered from float32 parameters of about its size, so it carries their rounding)
GRAD_TOL = 1e-5


class EmbeddingBagModel(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode=mode)
        self.out = nn.Linear(4, 3)

    def forward(self, x, offsets):
        return self.out(self.bag(x, offsets))


class SDPAModel(nn.Module):
    """q, k, v from one projection; ``mask``: None (causal), "bool" or "float"."""

    def __init__(self, mask=None):
        super().__init__()
        self.mask = mask
        self.qkv = nn.Linear(8, 24, bias=False)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, 2, 4).transpose(1, 2) for t in (q, k, v))
        if self.mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.mask == "bool":
            keep = torch.ones(s, s, dtype=torch.bool).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            bias = torch.arange(s, dtype=torch.float32).view(1, s) * -0.25
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(s, s))
        return self.out(y.transpose(1, 2).reshape(b, s, d).mean(1))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryModel(nn.Module):
    """Llama's rotary embedding: cos/sin tables from inverse frequencies, rotate_half."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        s, d = x.shape[1], x.shape[2]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        q = self.proj(x)
        q = q * emb.cos() + _rotate_half(q) * emb.sin()
        return self.out(q.mean(1))


class LlamaRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class NormModel(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = norm
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.norm(self.proj(x)))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 16, bias=False)
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 3, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Seq(nn.Module):
    """A layer, an activation or pooling, flatten, a classifier head."""

    def __init__(self, *layers):
        super().__init__()
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        return self.body(x).flatten(1)


class ViTStem(nn.Module):
    """Patch embedding, class token prepended with torch.cat, position embedding."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(1, 8, 2, stride=2)
        self.cls = nn.Parameter(torch.randn(1, 1, 8) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 5, 8) * 0.1)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        cls = self.cls.expand(x.shape[0], -1, -1)
        tokens = torch.cat((cls, tokens), dim=1) + self.pos
        return self.out(tokens[:, 0] + tokens[:, 1:].mean(1))


class MaskedFillModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        y = self.proj(x)
        return y.masked_fill(x > 0.5, 0.0).masked_fill(y < -0.5, -1.0)


class AddmmModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4) * 0.3)
        self.b = nn.Parameter(torch.randn(4) * 0.1)
        self.m = nn.Parameter(torch.randn(1, 2, 3) * 0.3)
        self.bias3 = nn.Parameter(torch.randn(1, 2, 3) * 0.1)

    def forward(self, x):
        h = torch.addmm(self.b, x, self.w, beta=0.5, alpha=2.0).view(-1, 2, 2)
        batch = h.shape[0]
        y = torch.baddbmm(self.bias3.expand(batch, 2, 3), h, self.m.expand(batch, 2, 3),
                          beta=0.7, alpha=1.5)
        return y.flatten(1)


class CoordinateIndexModel(nn.Module):
    """Advanced indexing with coordinate lists (frontend/indexing.py): ``h[:, rows, cols]``
    (DLRM's pick of pairwise products: one element per (row, col) pair, in place of the
    indexed axes) and ``h[rows, :, cols]`` (a slice between them: the picked dimension
    first), negative indices included."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("rows", torch.tensor([1, 2, -1, 0]), persistent=False)
        self.register_buffer("cols", torch.tensor([0, 3, 1, -2]), persistent=False)

    def forward(self, x):  # (3, 4, 4)
        h = torch.tanh(self.proj(x))
        adjacent = h[:, self.rows, self.cols]  # (3, 4)
        separated = h[self.rows[:3] - 1, :, self.cols[:3]]  # rows 0, 1, -2: (3, 4)
        return torch.cat([adjacent, separated * 2.0], dim=1)


class IntegerMaskModel(nn.Module):
    """Attention whose mask and scales come from integer/bool tensors (a padding mask): the
    cumsum of a bool tensor, int64 floor division and remainder, advanced indexing of an int
    tensor, comparisons; no gradient flows through any of them."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, pad):
        keep = ~pad
        pos = torch.cumsum(keep, dim=1) - 1
        rows = torch.arange(pad.shape[0])[:, None].expand_as(pos)
        seen = keep.long()[rows, pos.clamp(min=0)]  # index_tensor on int64 data
        scale = ((pos // 2) % 3).float() + seen.float() + 1.0
        causal = torch.ones(pad.shape[1], pad.shape[1], dtype=torch.bool).tril()
        mask = causal[None] & keep[:, None, :]
        h = self.proj(x) * scale[..., None]
        att = (h @ h.transpose(1, 2) * 0.1).masked_fill(~mask, float("-inf")).softmax(-1)
        return (att @ h).mean(1)


def _cases():
    g = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    cases = {
        "embedding_bag_sum": (lambda: EmbeddingBagModel("sum"),
                              lambda: (torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]),
                                       torch.tensor([0, 3, 5]))),
        "embedding_bag_mean": (lambda: EmbeddingBagModel("mean"),
                               lambda: (torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]),
                                        torch.tensor([0, 2, 7]))),
        "sdpa_causal": (lambda: SDPAModel(), lambda: (randn(2, 4, 8),)),
        "sdpa_bool_mask": (lambda: SDPAModel("bool"), lambda: (randn(2, 4, 8),)),
        "sdpa_float_mask": (lambda: SDPAModel("float"), lambda: (randn(2, 4, 8),)),
        "rotary": (RotaryModel, lambda: (randn(2, 4, 8),)),
        "rms_norm": (lambda: NormModel(nn.RMSNorm(8, eps=1e-6)), lambda: (randn(3, 8),)),
        "rms_norm_llama": (lambda: NormModel(LlamaRMSNorm(8)), lambda: (randn(3, 8),)),
        "group_norm": (lambda: Seq(nn.Conv2d(2, 4, 1), nn.GroupNorm(2, 4)),
                       lambda: (randn(2, 2, 3, 3),)),
        "swiglu": (SwiGLU, lambda: (randn(3, 8),)),
        "gelu_tanh": (lambda: Seq(nn.Linear(6, 5), nn.GELU(approximate="tanh")),
                      lambda: (randn(3, 6),)),
        "hardswish": (lambda: Seq(nn.Linear(6, 5), nn.Hardswish()), lambda: (randn(3, 6) * 3,)),
        "hardsigmoid": (lambda: Seq(nn.Linear(6, 5), nn.Hardsigmoid()),
                        lambda: (randn(3, 6) * 3,)),
        # a stride-2 depth (the transposed convolution needs output padding), overlapping
        # max windows, a padded average
        "conv3d_pool3d": (lambda: Seq(nn.Conv3d(1, 2, 3, stride=(2, 1, 1), padding=1),
                                      nn.MaxPool3d(2, stride=(1, 2, 2)),
                                      nn.AvgPool3d((1, 2, 2), padding=(0, 1, 1))),
                          lambda: (randn(2, 1, 4, 4, 4),)),
        "adaptive_avg_pool_1x1": (lambda: Seq(nn.Conv2d(1, 3, 3), nn.AdaptiveAvgPool2d(1)),
                                  lambda: (randn(2, 1, 5, 5),)),
        "adaptive_avg_pool_2x3": (lambda: Seq(nn.Conv2d(1, 3, 1), nn.AdaptiveAvgPool2d((2, 3))),
                                  lambda: (randn(2, 1, 5, 7),)),
        "depthwise_conv2d": (lambda: Seq(nn.Conv2d(4, 4, 3, groups=4, padding=1)),
                             lambda: (randn(2, 4, 3, 3),)),
        "grouped_conv2d": (lambda: Seq(nn.Conv2d(4, 6, 3, groups=2)),
                           lambda: (randn(2, 4, 4, 4),)),
        "multihead_attention": (lambda: MHA(), lambda: (randn(2, 4, 8),)),
        "vit_class_token": (ViTStem, lambda: (randn(2, 1, 4, 4),)),
        "masked_fill": (MaskedFillModel, lambda: (randn(3, 6),)),
        "addmm_baddbmm": (AddmmModel, lambda: (randn(3, 6),)),
        "coordinate_index": (CoordinateIndexModel, lambda: (randn(3, 4, 4),)),
        "integer_mask": (IntegerMaskModel,
                         lambda: (randn(2, 4, 4), torch.tensor([[False] * 4,
                                                                 [False, False, True, True]]))),
    }
    return cases


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.out(y.mean(1))


CASES = _cases()


def _train_one_step(name):
    make_module, make_inputs = CASES[name]
    torch.manual_seed(0)
    module = make_module()
    inputs = make_inputs()
    out = module(*inputs)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    before = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    model = raf_dist.frontend.from_pytorch(module, inputs)
    trainer = raf_dist.Trainer(model, loss="mse", optimizer=raf_dist.optim.SGD(lr=LR))
    loss = trainer.step(tuple(t.numpy() for t in inputs), target.numpy())
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    opt.zero_grad()
    ref = F.mse_loss(module(*inputs), target)
    ref.backward()
    opt.step()
    return loss, ref.item(), trainer.state_dict(), module, before


@pytest.mark.parametrize("name", sorted(CASES))
def test_operator_trains_as_pytorch(name):
    loss, ref_loss, params, module, before = _train_one_step(name)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (loss, ref_loss)
    assert sorted(params) == sorted(n for n, _ in module.named_parameters())
    for key, p in module.named_parameters():
        want = p.detach().numpy()
        assert rel_err(params[key], want) <= TOL, key
        assert rel_err(params[key] - before[key], want - before[key]) <= GRAD_TOL, key


class _Inner(nn.Module):
    def forward(self, x):
        return torch.logcumsumexp(x, dim=1)  # no converter in TVM 0.27's importer


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Identity(), _Inner()])

    def forward(self, x):
        return self.blocks[1](self.proj(x))


def test_unknown_operator_names_op_and_module_path():
    with pytest.raises(ValueError) as info:
        raf_dist.frontend.from_pytorch(_Outer(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "logcumsumexp" in message and "blocks.1" in message and "_Inner" in message, message
    assert "Traceback" not in message and "tvm" not in message.lower().replace(
        "raf_dist", ""), message
