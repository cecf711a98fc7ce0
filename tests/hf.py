"""Hugging Face causal language models as their library builds them, at sizes 2 cores compile
quickly: GPT-2 (``GPT2LMHeadModel``: tied token embedding and head, Conv1D projections, GELU)
and Llama (``LlamaForCausalLM``: rotary embeddings, RMSNorm, SiLU MLP, grouped-query
attention). Default configuration otherwise: the default attention implementation (sdpa), no
attention mask, random initialisation from a fixed seed. Shared by the numeric and the
distributed tier."""
import torch
from torch import nn

VOCAB = 64
SEQ = 8
HF_MODELS = ("gpt2", "llama")


class LogitsOnly(nn.Module):
    """``input_ids -> logits`` of a Hugging Face causal LM (whose forward returns a
    ModelOutput; from_pytorch and the loss need one tensor). Nothing else is changed: the
    model is called as a user calls it, ``model(input_ids)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids).logits


def import_transformers():
    """``transformers``, kept off torchvision unless it is already imported: its image utilities
    import torchvision whenever it is installed, and a torchvision built for another torch fails
    on import (its compiled operators do not load). Language models need none of it."""
    import sys

    import transformers
    import transformers.utils
    from transformers.utils import import_utils

    if "torchvision" not in sys.modules:
        import_utils.is_torchvision_available = transformers.utils.is_torchvision_available = \
            lambda: False
    return transformers


def hf_model(name: str, seed: int = 0, attention: str = "sdpa") -> LogitsOnly:
    """GPT-2 or Llama, tiny, initialised from ``seed``; ``attention``: transformers'
    attn_implementation ("sdpa", its default, or "eager": the softmax written out).

    Dropout (GPT-2's default 0.1 on embeddings, attention and residuals) is off: raf_dist draws
    its dropout masks from its own seeded generator and PyTorch from its own, so no comparison
    of the two could hold with it on (Llama's default attention dropout is 0 already)."""
    transformers = import_transformers()
    torch.manual_seed(seed)
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                         n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, attn_implementation=attention)
        model = transformers.GPT2LMHeadModel(config)
    elif name == "llama":
        # 4 query heads sharing 2 key/value heads: grouped-query attention (repeat_kv)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=SEQ,
                                          attn_implementation=attention)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown Hugging Face test model {name!r}; expected one of {HF_MODELS}")
    return LogitsOnly(model).train()


def make_hf(name: str, batch: int, seed: int = 0, attention: str = "sdpa"):
    """(module, input_ids, targets): targets are the next tokens of a random sequence (the
    last position predicts a random token), one per position, as the transformer case of
    tests/models.py."""
    module = hf_model(name, seed, attention)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
    return module, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()



# The optimizer both sides train with: AdamW, lr 1e-2, eps 1e-6 (PyTorch's default eps is 1e-8).
# Adam divides each gradient element by its own running magnitude, so an element whose gradient
# sits at the rounding-noise floor of its sum (GPT-2's key biases: exactly zero in exact
# arithmetic, since softmax over the keys ignores a shift shared by every key; or an element
# whose contributions cancel, |g| ~ 1e-8 against a median of 2e-3) moves by up to
# lr * |g| / (|g| + eps) in a direction set by that noise, different in every implementation and
# every batch split. With eps 1e-8 that is ~lr/2 (measured: 2e-4 norm-relative on a c_fc.bias
# at batch 4, and the key biases' noise of 1e-11 became 6e-5 steps); with eps 1e-6 a gradient
# below 1e-6 is no longer normalised to a full step, so rounding noise stays rounding noise,
# while every real gradient here (>= 1e-4) still gets Adam's normalised steps.
LR, EPS = 1e-2, 1e-6


def torch_adamw(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


def raf_adamw():
    import raf_dist

    return raf_dist.optim.AdamW(lr=LR, eps=EPS)
