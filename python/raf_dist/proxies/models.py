"""The proxies' models, written with ``raf_dist.nn`` (TVM's relax.frontend.nn) and captured
with shapes only: no parameter holds memory (``raf_dist.model.value_placeholder``), so the
extraction reads GPT-3 175B's step on any machine. They are ordinary raf_dist models — the
same passes split and distribute them as any captured model (tensor-parallel plan found on
the graph, pipeline cuts at the residual joins, tables found by their lookups)."""
from __future__ import annotations

import math

import numpy as np
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..frontend import from_relax_nn


class _Block(nn.Module):
    """A pre-norm GPT block: causal-free multi-head attention and a 4x GELU MLP (the
    proxies time the matmuls, which the mask does not change)."""

    def __init__(self, hidden: int, heads: int):
        self.heads, self.hidden = heads, hidden
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, d = (int(v) for v in x.shape)
        h, dh = self.heads, d // self.heads
        q, k, v = op.split(self.qkv(self.ln1(x)), 3, axis=2)

        def heads(t):
            return op.permute_dims(op.reshape(t, (b, s, h, dh)), [0, 2, 1, 3])

        scores = op.matmul(heads(q), op.permute_dims(heads(k), [0, 1, 3, 2]))
        att = op.softmax(scores * (1.0 / math.sqrt(dh)), axis=-1)
        o = op.reshape(op.permute_dims(op.matmul(att, heads(v)), [0, 2, 1, 3]), (b, s, d))
        x = x + self.proj(o)
        return x + self.out(op.gelu(self.fc(self.ln2(x))))


class _LlamaBlock(nn.Module):
    """A Llama block: RMSNorm, grouped-query attention (``kv_heads`` key / value heads, each
    shared by heads / kv_heads query heads), a SwiGLU MLP of ``intermediate`` (rotary
    embeddings left out: elementwise work the proxies' cost model barely sees)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int):
        self.heads, self.kv_heads = heads, kv_heads
        dh = hidden // heads
        self.norm1 = nn.RMSNorm(hidden, axes=-1, bias=False)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * dh, bias=False)
        self.v = nn.Linear(hidden, kv_heads * dh, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden, axes=-1, bias=False)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        b, s, d = (int(v) for v in x.shape)
        h, g = self.heads, self.kv_heads
        dh = d // h
        y = self.norm1(x)

        def heads(t, n):
            t = op.permute_dims(op.reshape(t, (b, s, n, dh)), [0, 2, 1, 3])
            return op.repeat(t, h // n, axis=1) if n != h else t

        q, k, v = heads(self.q(y), h), heads(self.k(y), g), heads(self.v(y), g)
        scores = op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])) * (1.0 / math.sqrt(dh))
        o = op.matmul(op.softmax(scores, axis=-1), v)
        x = x + self.o(op.reshape(op.permute_dims(o, [0, 2, 1, 3]), (b, s, d)))
        y = self.norm2(x)
        return x + self.down(op.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                 vocab: int):
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([_LlamaBlock(hidden, heads, kv_heads, intermediate)
                                     for _ in range(layers)])
        self.norm = nn.RMSNorm(hidden, axes=-1, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int):
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Parameter((seq, hidden))
        self.blocks = nn.ModuleList([_Block(hidden, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class DLRM(nn.Module):
    """Naumov et al.'s DLRM: a bottom MLP over the dense features, one lookup per table, the
    dot products of every pair of the (bottom output, rows) vectors, a top MLP."""

    def __init__(self, dense: int, bottom: list[int], tables: list[int], dim: int,
                 top: list[int]):
        sizes = [dense] + list(bottom)
        self.bottom = nn.ModuleList([nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])
        self.tables = nn.ModuleList([nn.Embedding(rows, dim) for rows in tables])
        features = len(tables) + 1
        self.pairs = [i * features + j for i in range(features) for j in range(i)]
        sizes = [dim + len(self.pairs)] + list(top)
        self.top = nn.ModuleList([nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])

    def forward(self, dense, ids):
        x = dense
        for layer in self.bottom:
            x = op.relu(layer(x))
        b, dim = (int(v) for v in x.shape)
        rows = [op.reshape(table(op.reshape(op.take(ids, op.reshape(
            nn.Tensor.from_const(np.array([t], "int64")), (1,)), axis=1), (b,))), (b, 1, dim))
            for t, table in enumerate(self.tables)]
        t = op.concat([op.reshape(x, (b, 1, dim))] + rows, dim=1)
        z = op.reshape(op.matmul(t, op.permute_dims(t, [0, 2, 1])), (b, -1))
        z = op.take(z, nn.Tensor.from_const(np.array(self.pairs, "int64")), axis=1)
        x = op.concat([x, z], dim=1)
        for i, layer in enumerate(self.top):
            x = layer(x)
            if i + 1 < len(self.top):
                x = op.relu(x)
        return x


def _capture(module: nn.Module, input_specs):
    """``module`` captured with placeholder parameters (shapes, no memory)."""
    placeholders = {name: np.broadcast_to(np.zeros((), p.dtype), tuple(int(d) for d in p.shape))
                    for name, p in module.named_parameters()}
    return from_relax_nn(module, input_specs, init_params=placeholders)


def gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int, batch: int):
    """A GPT at ``batch`` sequences of ``seq`` tokens, shapes only."""
    return _capture(GPT(layers, hidden, heads, seq, vocab), [((batch, seq), "int64")])


def dlrm(batch: int, dense: int, bottom: list[int], tables: list[int], dim: int,
         top: list[int]):
    """A DLRM at ``batch`` samples (dense features, one id per table), shapes only."""
    return _capture(DLRM(dense, bottom, tables, dim, top),
                    [((batch, dense), "float32"), ((batch, len(tables)), "int64")])


def llama(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, seq: int,
          vocab: int, batch: int):
    """A Llama at ``batch`` sequences of ``seq`` tokens, shapes only."""
    return _capture(Llama(layers, hidden, heads, kv_heads, intermediate, vocab),
                    [((batch, seq), "int64")])


#: the planner's and proxies' named models: (builder, its keyword arguments but seq / batch)
MODELS = {
    "gpt3-175b": (gpt, dict(layers=96, hidden=12288, heads=96, vocab=51200)),
    "gpt2-xl": (gpt, dict(layers=48, hidden=1600, heads=25, vocab=50257)),
    "gpt2": (gpt, dict(layers=12, hidden=768, heads=12, vocab=50257)),
    "llama3-8b": (llama, dict(layers=32, hidden=4096, heads=32, kv_heads=8,
                              intermediate=14336, vocab=128256)),
}
