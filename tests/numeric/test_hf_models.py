"""Numeric tier: Hugging Face models as users build them (tests/hf.py): GPT-2 (tied token
embedding and head) and Llama (rotary embeddings, RMSNorm, SiLU MLP, grouped-query attention)
with the default attention implementation (sdpa) and no attention mask, imported with
``from_pytorch`` and trained 3 AdamW steps against PyTorch on the same batch: losses, every
parameter and every buffer agree, and ``state_dict()`` is keyed as ``named_parameters()``.
The 2-rank version (GPT-2, data parallel and ZeRO-3) is tests/distributed/test_hf_models.py.

Also the root cause of "sdpa fails on import": PyTorch 2.13's decomposition of CPU attention
gives its output another memory layout than the operator promised, so a later view fails
inside ``run_decompositions`` (raf_dist/frontend/decompositions.py); a failure there is
reported as PyTorch's.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import raf_dist
from raf_dist.frontend import decompositions
from hf import make_hf, raf_adamw, torch_adamw
from models import rel_err, torch_step

STEPS = 3
BATCH = 2
# Norm-relative, float32. raf_dist and PyTorch evaluate the same formulas with other reduction
# orders and other last bits in exp/rsqrt/sigmoid (softmax, layer and RMS norms, GELU, SiLU,
# the tied weight's two gradient contributions): ~1e-7 relative per op. Adam's per-element
# normalisation amplifies that where a gradient element is near eps (tests/hf.py, why eps is
# 1e-6). Measured after 3 steps: GPT-2 <= 2.0e-5 (a LayerNorm bias), Llama <= 1.4e-5 (a value
# projection). 1e-4 leaves a 5x margin and is far below what a missing or wrong gradient term
# gives (> 1e-2: AdamW's first steps move every element by ~lr = 1e-2).
TOL = 1e-4


def train_both(name, batch=BATCH, steps=STEPS):
    """(trainer, reference module, losses, reference losses) after ``steps`` AdamW steps of
    raf_dist and of PyTorch on the same batch, from the same initial values."""
    pytest.importorskip("transformers")
    module, x, y = make_hf(name, batch)
    reference = copy.deepcopy(module).train()
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_adamw())
    opt = torch_adamw(reference.parameters())
    losses, ref_losses = [], []
    for _ in range(steps):
        losses.append(trainer.step(x.numpy(), y.numpy()))
        ref_losses.append(torch_step(reference, opt, x, y))
    return trainer, reference, losses, ref_losses


@pytest.fixture(scope="module")
def gpt2():
    return train_both("gpt2")


@pytest.fixture(scope="module")
def llama():
    return train_both("llama")


def assert_trained_like_pytorch(run):
    trainer, reference, losses, ref_losses = run
    assert rel_err(losses, ref_losses) <= TOL, (losses, ref_losses)
    params = trainer.state_dict()
    assert list(params) == [n for n, _ in reference.named_parameters()]
    errors = {n: rel_err(params[n], p.detach().numpy()) for n, p in reference.named_parameters()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, (worst, errors[worst])
    buffers = trainer.buffers_dict()
    assert list(buffers) == [n for n, _ in reference.named_buffers()]
    for n, b in reference.named_buffers():  # constants (Llama's rotary frequencies)
        np.testing.assert_array_equal(buffers[n], b.numpy(), err_msg=n)


def test_gpt2_default_sdpa_trains_like_pytorch(gpt2):
    trainer, reference = gpt2[:2]
    assert reference.model.config._attn_implementation == "sdpa"
    assert_trained_like_pytorch(gpt2)
    # the head is the token embedding: one parameter, trained once, named as named_parameters()
    assert reference.model.lm_head.weight is reference.model.transformer.wte.weight
    assert trainer.model.tied_params == {"model.lm_head.weight": "model.transformer.wte.weight"}
    assert "model.lm_head.weight" not in trainer.state_dict()
    assert trainer.signature.param_names.count("model.transformer.wte.weight") == 1


def test_llama_default_sdpa_trains_like_pytorch(llama):
    reference = llama[1]
    assert reference.model.config._attn_implementation == "sdpa"
    assert reference.model.config.num_key_value_heads < reference.model.config.num_attention_heads
    assert_trained_like_pytorch(llama)


class SDPAThenConv1D(nn.Module):
    """GPT-2's attention in miniature: q, k, v laid out (batch, seq, heads, dim) in memory,
    CPU sdpa, ``transpose(1, 2).contiguous()`` (a no-op on the operator's output, so export
    records no copy), then a view merging batch and seq (GPT-2's Conv1D)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, 2, 4).transpose(1, 2) for t in self.qkv(x).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().reshape(b, s, d)
        return self.out(y.view(-1, d)).view(b, s, -1)


def test_cpu_attention_decomposition_keeps_the_operators_layout():
    """torch's own table fails on the pattern (if a later PyTorch fixes it, only the first
    assertion needs to go); raf_dist's decomposes it, and the values are PyTorch's."""
    module, x = SDPAThenConv1D(), torch.randn(2, 5, 8)
    exported = torch.export.export(module, (x,))
    with pytest.raises(Exception, match="view"):
        exported.run_decompositions()
    program = decompositions.run_decompositions(exported, "SDPAThenConv1D")
    with torch.no_grad():
        np.testing.assert_allclose(program.module()(x).numpy(), module(x).numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_decomposition_failure_names_pytorch(monkeypatch):
    """With PyTorch's table the capture fails inside torch: the error says so (and where to
    fix it), not that the Relax importer or an operator is unsupported."""
    import torch.export

    monkeypatch.setattr(decompositions, "decomposition_table", torch.export.default_decompositions)
    with pytest.raises(decompositions.DecompositionError) as info:
        raf_dist.frontend.from_pytorch(SDPAThenConv1D(), (torch.randn(2, 5, 8),))
    message = str(info.value)
    assert "run_decompositions" in message and "PyTorch" in message, message
    assert "SDPAThenConv1D" in message and "view" in message, message
    assert "Relax importer does not support" not in message, message


class _EmptyCache(nn.Module):
    """Hugging Face's DynamicCache in miniature: keys appended to ``torch.tensor([])``."""

    def forward(self, keys):
        return torch.cat([torch.tensor([]), keys], dim=-2)


class _CachedKeys(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.cache = _EmptyCache()

    def forward(self, x):
        return self.cache(self.proj(x).view(2, 1, 3, 4))


def test_converter_failure_names_the_importer_and_where(monkeypatch):
    """Without raf_dist's cat converter (PyTorch skips empty 1-D inputs, Relax's concat
    refuses them) TVM's converter fails: the error names the Relax importer, the aten operator
    and the module path, not torch.export."""
    from raf_dist.frontend import torch_ops

    own = torch_ops.converters()
    monkeypatch.setattr(torch_ops, "converters", lambda: {
        k: v for k, v in own.items() if k not in ("cat.default", "concat.default")})
    with pytest.raises(torch_ops.ConversionError) as info:
        raf_dist.frontend.from_pytorch(_CachedKeys(), (torch.randn(2, 3, 4),))
    message = str(info.value)
    assert "Relax importer failed to convert aten.cat.default" in message, message
    assert "cache (_EmptyCache)" in message and "ndim" in message, message
    assert "torch.export failed" not in message, message
    monkeypatch.undo()
    model = raf_dist.frontend.from_pytorch(_CachedKeys(), (torch.randn(2, 3, 4),))
    assert [int(d) for d in model.forward.ret_ty.shape] == [2, 1, 3, 4]


def test_gpt2_default_dropout_is_captured_and_trains():
    """GPT-2's default dropout (0.1 on embeddings, attention probabilities inside sdpa, and
    both residual branches) is captured as raf_dist's seeded masks: the step cannot equal
    PyTorch's (other random masks), so this checks capture and that training makes progress."""
    from hf import LogitsOnly, import_transformers

    pytest.importorskip("transformers")
    transformers = import_transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=1,
                                     n_head=2)
    assert config.attn_pdrop == config.resid_pdrop == config.embd_pdrop == 0.1
    module = LogitsOnly(transformers.GPT2LMHeadModel(config))
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 8), generator=gen) for _ in range(2))
    model = raf_dist.frontend.from_pytorch(module, (x,))
    assert [rate for _, _, rate in model.dropout_specs] == [0.1] * 4
    trainer = raf_dist.Trainer(model, optimizer=raf_adamw())
    losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
