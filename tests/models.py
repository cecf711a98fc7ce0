"""PyTorch models shared by the numeric and distributed tiers (small enough for 2 cores)."""
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, sizes=(20, 32, 32, 5)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class CNN(nn.Module):
    """conv2d, max and avg pooling, flatten."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 2 * 2, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


class TransformerBlock(nn.Module):
    """GPT-style block: embedding, layer_norm, split, transpose/reshape, causal mask through
    tril/masked_fill, softmax, gelu, residuals."""

    def __init__(self, vocab=24, d=16, heads=2, seq=8):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1)
        self.ln1 = nn.LayerNorm(d)
        # No qkv bias: the key bias has an exactly-zero true gradient (softmax ignores a shift
        # shared by all keys), so Adam would turn float noise into +-lr steps whose sign depends
        # on reduction order, making any comparison with PyTorch meaningless for that slice.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        batch, seq = idx.shape
        x = self.tok(idx) + self.pos
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(batch, seq, -1)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


class SDPALM(nn.Module):
    """A Llama-like causal LM written with F.scaled_dot_product_attention(is_causal=True):
    RMSNorm, SwiGLU, two blocks (the long-sequence benchmark's model in miniature,
    bench/long_sequence.py)."""

    def __init__(self, vocab=32, d=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.norm1, block.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
            block.qkv = nn.Linear(d, 3 * d, bias=False)
            block.out = nn.Linear(d, d, bias=False)
            block.gate = nn.Linear(d, 2 * d, bias=False)
            block.up = nn.Linear(d, 2 * d, bias=False)
            block.down = nn.Linear(2 * d, d, bias=False)
            self.blocks.append(block)
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        batch, seq = idx.shape
        x = self.tok(idx)
        for b in self.blocks:
            q, k, v = b.qkv(b.norm1(x)).split(x.shape[-1], dim=-1)
            q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b.out(y.transpose(1, 2).reshape(batch, seq, -1))
            h = b.norm2(x)
            x = x + b.down(F.silu(b.gate(h)) * b.up(h))
        return self.head(self.norm(x))


class FlatLM(TransformerBlock):
    """nanoGPT's interface: logits flattened to ``(batch * seq, vocab)`` against targets of
    shape ``(batch * seq,)`` (the target's rows are not the input's rows)."""

    def forward(self, idx):
        logits = super().forward(idx)
        return logits.reshape(-1, logits.shape[-1])


class MHAClassifier(nn.Module):
    """torch.nn.MultiheadAttention, then mean pooling."""

    def __init__(self, d=16, heads=2, classes=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, bias=False)  # see TransformerBlock
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.out(y.mean(dim=1))


class SDPAClassifier(nn.Module):
    """F.scaled_dot_product_attention (causal)."""

    def __init__(self, d=16, heads=2, classes=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # see TransformerBlock
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        batch, seq, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, d).mean(dim=1))


class TiedLM(nn.Module):
    """GPT-2's weight tying in miniature: the output head is the token embedding
    (``head.weight is tok.weight``), so named_parameters() lists it once as ``tok.weight``
    while state_dict() lists both names."""

    def __init__(self, vocab=16, d=8, seq=5):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.tok(idx) + self.pos)))


class BatchNormCNN(nn.Module):
    """conv2d + BatchNorm2d (running statistics) + max pooling."""

    def __init__(self, classes=10):
        super().__init__()
        # no bias before batch norm (as ResNet): its true gradient is 0, and Adam would turn
        # the float noise in it into full-size steps in arbitrary directions
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(x, 1))


class ResidualBatchNormCNN(nn.Module):
    """A ResNet basic block in miniature: BatchNorm after every convolution (no conv bias,
    as ResNet), a residual connection, then pooling and a linear head."""

    def __init__(self, channels=4, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels * 4 * 4, classes)

    def forward(self, x):
        x = F.relu(self.bn0(self.stem(x)))
        x = F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(F.max_pool2d(x, 2), 1))


class BatchNormMLP(nn.Module):
    """BatchNorm1d with the default momentum and one with momentum=None (cumulative average),
    and one without affine parameters."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 16, bias=False)  # no bias before batch norm (see BatchNormCNN)
        self.bn1 = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 16, bias=False)
        self.bn2 = nn.BatchNorm1d(16, momentum=None, affine=False)
        self.fc3 = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.fc1(x)))
        return self.fc3(F.relu(self.bn2(self.fc2(x))))


class BatchNorm3dNet(nn.Module):
    """conv3d + BatchNorm3d (momentum 0.3)."""

    def __init__(self, classes=4):
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm3d(3, momentum=0.3)
        self.fc = nn.Linear(3 * 4 * 4 * 4, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.bn(self.conv(x))), 1))


class CausalMaskNet(nn.Module):
    """Constant buffers: a non-persistent causal mask and a persistent scale table that
    nothing writes (IR constants)."""

    def __init__(self, seq=6, d=8, classes=4):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)), persistent=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        h = torch.tanh(self.proj(x)) * self.scale
        mixed = (self.mask / self.mask.sum(-1, keepdim=True)) @ h  # causal running average
        return self.out(mixed.mean(dim=1))


def make(name, batch, seed=0):
    """(module, example input, target) with deterministic data for a global batch;
    ``hf_gpt2`` / ``hf_llama``: the Hugging Face models of tests/hf.py."""
    if name.startswith("hf_"):
        from hf import make_hf

        return make_hf(name[3:], batch, seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "mlp":
        return MLP(), torch.randn(batch, 20, generator=gen), torch.randint(0, 5, (batch,), generator=gen)
    if name == "mlp8":  # 8 linear layers: pipelines of 2, 3 and 4 stages
        return (MLP((20,) + (32,) * 7 + (5,)), torch.randn(batch, 20, generator=gen),
                torch.randint(0, 5, (batch,), generator=gen))
    if name == "wide_mlp":  # parameters dominate activations: memory accounting cases
        return (MLP((64,) + (256,) * 7 + (10,)), torch.randn(batch, 64, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen))
    if name == "cnn":
        return (CNN(), torch.randn(batch, 1, 8, 8, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen))
    if name == "transformer":
        return (TransformerBlock(), torch.randint(0, 24, (batch, 8), generator=gen),
                torch.randint(0, 24, (batch, 8), generator=gen))
    if name == "transformer4":  # 4 heads: splits over 2 and 4 tensor-parallel ranks
        return (TransformerBlock(heads=4), torch.randint(0, 24, (batch, 8), generator=gen),
                torch.randint(0, 24, (batch, 8), generator=gen))
    if name == "flat_lm":  # targets (batch * 8,): 8 target rows per input row
        return (FlatLM(heads=4), torch.randint(0, 24, (batch, 8), generator=gen),
                torch.randint(0, 24, (batch * 8,), generator=gen))
    if name == "sdpa_lm":  # 16 tokens: 2 x 4 context-parallel chunks
        return (SDPALM(), torch.randint(0, 32, (batch, 16), generator=gen),
                torch.randint(0, 32, (batch, 16), generator=gen))
    if name == "tied":
        return (TiedLM(), torch.randint(0, 16, (batch, 5), generator=gen),
                torch.randint(0, 16, (batch, 5), generator=gen))
    if name == "mha":
        return MHAClassifier(), torch.randn(batch, 6, 16, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
    if name == "sdpa":
        return SDPAClassifier(), torch.randn(batch, 6, 16, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
    if name == "bn_cnn":
        return (BatchNormCNN(), torch.randn(batch, 1, 8, 8, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen))
    if name == "res_bn":
        return (ResidualBatchNormCNN(), torch.randn(batch, 1, 8, 8, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen))
    if name == "bn_mlp":
        return (BatchNormMLP(), torch.randn(batch, 20, generator=gen) * 2 + 1,
                torch.randint(0, 5, (batch,), generator=gen))
    if name == "bn3d":
        return (BatchNorm3dNet(), torch.randn(batch, 2, 4, 4, 4, generator=gen),
                torch.randint(0, 4, (batch,), generator=gen))
    if name == "causal_mask":
        return (CausalMaskNet(), torch.randn(batch, 6, 8, generator=gen),
                torch.randint(0, 4, (batch,), generator=gen))
    raise ValueError(name)


def transformer4():
    """make("transformer4") at 4 rows: a factory for raf_dist.tools.explain_plan."""
    return make("transformer4", 4)


def torch_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    if name == "sgd_nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05, lr_decay=0.01, weight_decay=1e-3,
                                   initial_accumulator_value=0.1)
    if name == "rowwise_adagrad":
        return TorchRowWiseAdagrad(params, lr=0.05, lr_decay=0.01)
    raise ValueError(name)


class TorchRowWiseAdagrad(torch.optim.Optimizer):
    """torchrec.optim.RowWiseAdagrad's update (torchrec is not a dependency): per parameter
    ``sum += mean(g * g over the row)``, ``p -= clr * g / (sqrt(sum) + eps)`` with
    ``clr = lr / (1 + (step - 1) * lr_decay)``; its state of a (rows, ...) parameter is
    (rows, 1, ...) (torchrec's: (rows, 1) of a table); a 1-D parameter is its own rows, as
    raf_dist's (torchrec's takes 2-D tables only)."""

    def __init__(self, params, lr=1e-2, lr_decay=0.0, eps=1e-10):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                g = p.grad
                if not state:
                    state["step"] = 0
                    shape = p.shape if p.dim() < 2 else (p.shape[0],) + (1,) * (p.dim() - 1)
                    state["sum"] = torch.zeros(shape, dtype=p.dtype)
                state["step"] += 1
                clr = group["lr"] / (1 + (state["step"] - 1) * group["lr_decay"])
                squares = g * g
                if p.dim() >= 2:
                    squares = squares.mean(dim=tuple(range(1, p.dim())), keepdim=True)
                state["sum"] += squares
                p.addcdiv_(g, state["sum"].sqrt() + group["eps"], value=-clr)


def raf_optimizer(name):
    import raf_dist

    if name == "sgd":
        return raf_dist.optim.SGD(lr=0.05)
    if name == "sgd_momentum":
        return raf_dist.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3)
    if name == "sgd_nesterov":
        return raf_dist.optim.SGD(lr=0.05, momentum=0.9, nesterov=True)
    if name == "adam":
        return raf_dist.optim.Adam(lr=1e-2, weight_decay=1e-3)
    if name == "adamw":
        return raf_dist.optim.AdamW(lr=1e-2)
    if name == "adagrad":
        return raf_dist.optim.Adagrad(lr=0.05, lr_decay=0.01, weight_decay=1e-3,
                                      initial_accumulator_value=0.1)
    if name == "rowwise_adagrad":
        return raf_dist.optim.RowWiseAdagrad(lr=0.05, lr_decay=0.01)
    if name == "hf_adamw":  # what tests/hf.py trains the Hugging Face models with
        from hf import raf_adamw

        return raf_adamw()
    raise ValueError(name)


def torch_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def torch_step(module, opt, x, y):
    """One PyTorch training step with ``torch_loss`` (``x``: the input, or a tuple of the
    inputs); returns the loss as a float."""
    opt.zero_grad()
    loss = torch_loss(module(*x) if isinstance(x, tuple) else module(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def torch_reference(name, opt_name, batch, steps, seed=0, autocast=None):
    """Losses and final parameters of ``steps`` PyTorch steps on the same data;
    ``autocast``: a torch dtype to run the forward under ``torch.autocast("cpu", dtype)``."""
    import torch

    module, x, y = make(name, batch, seed)
    opt = torch_optimizer(opt_name, module.parameters())
    if autocast is None:
        losses = [torch_step(module, opt, x, y) for _ in range(steps)]
    else:  # autocast around the forward and loss only, as PyTorch's AMP recipe does
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast):
                loss = torch_loss(module(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


def rel_err(a, b):
    """Norm-relative difference of ``a`` from ``b``."""
    import numpy as np

    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-12))


def single_process_reference(name, opt_name, global_batch, steps, keep=(), **trainer_args):
    """What the distributed workers compare against: rank 0 trains ``name`` alone on the whole
    global batch (data parallelism off) for ``steps`` steps while the other ranks sleep; every
    rank gets (losses, state_dict, optimizer_state_dict), and {attribute: value} of the
    trainer's attributes named in ``keep`` when given. Collective."""
    import raf_dist
    from raf_dist import distributed as dist

    comm = dist.get_communicator()
    reference = None
    if comm.rank == 0:
        config = dist.get_config()
        saved = {k: getattr(config, k) for k in ("enable_data_parallel", "zero_opt_level",
                                                 "tensor_parallel_size", "num_microbatches",
                                                 "pipeline_parallel_size",
                                                 "context_parallel_size",
                                                 "sequence_parallel")}
        config.update({"enable_data_parallel": False, "zero_opt_level": 0,
                       "tensor_parallel_size": 1, "num_microbatches": 1,
                       "pipeline_parallel_size": 1, "context_parallel_size": 1,
                       "sequence_parallel": False})
        module, x, y = make(name, global_batch, seed=0)
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                   optimizer=raf_optimizer(opt_name), local=True,
                                   **trainer_args)
        losses = [trainer.step(x.numpy(), y.numpy()) for _ in range(steps)]
        reference = (losses, trainer.state_dict(), trainer.optimizer_state_dict())
        if keep:
            reference += ({k: getattr(trainer, k) for k in keep},)
        config.update(saved)
    comm.idle_barrier()  # the others sleep while rank 0 compiles and runs the reference
    return comm.mpi_comm.bcast(reference, root=0)


def assert_like_one_process(trainer, losses, name, opt_name, global_batch, loaded, tol):
    """The distributed ``trainer``'s ``losses`` (its steps after ``loaded`` resumed ones), full
    parameters and optimizer state equal single_process_reference's on the global batch
    (norm-relative <= ``tol``; the same names, order and shapes). Collective. Returns
    (trainer.state_dict(), the reference's parameters)."""
    ref_losses, ref_params, ref_states = single_process_reference(
        name, opt_name, global_batch, loaded + len(losses))
    assert rel_err(losses, ref_losses[loaded:]) <= tol, (losses, ref_losses)
    params = trainer.state_dict()
    assert list(params) == list(ref_params)
    for key, value in ref_params.items():
        assert params[key].shape == value.shape, key
        assert rel_err(params[key], value) <= tol, (key, rel_err(params[key], value))
    states = trainer.optimizer_state_dict()
    for key, by_state in ref_states.items():
        for state, value in by_state.items():
            assert rel_err(states[key][state], value) <= tol, (key, state)
    return params, ref_params


def train_zero(name, batch, level, steps, device="cpu"):
    """(losses, trainer, x): ``steps`` AdamW steps of ``name`` on one fixed batch in this
    process, with data parallelism and ZeRO ``level`` switched on when level > 0 (tiny
    buckets, so models get several); the config is restored afterwards."""
    import raf_dist
    from raf_dist import distributed as dist

    module, x, y = make(name, batch)
    config = dist.get_config()
    config.update({"enable_data_parallel": level > 0, "zero_opt_level": level,
                   "bucket_size_mb": 0.001})
    try:
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                   optimizer=raf_optimizer("adamw"), device=device)
        return [trainer.step(x.numpy(), y.numpy()) for _ in range(steps)], trainer, x
    finally:
        config.update({"enable_data_parallel": False, "zero_opt_level": 0, "bucket_size_mb": 25})


class DLRM(nn.Module):
    """A DLRM-style recommender (Naumov et al. 2019, facebookresearch/dlrm) in miniature: a
    bottom MLP on the dense features; one ``nn.EmbeddingBag`` per sparse feature, looked up
    with offsets (bags of varying length, some empty), summed or averaged; the pairwise dot
    products of the resulting vectors (the strictly lower triangle of Z Z^T, picked with
    index tensors as the reference implementation does); a top MLP on the dense vector and
    those interactions. ``forward(dense, indices, offsets)``: indices (tables, L) and offsets
    (tables, batch), one row per table (int64)."""

    def __init__(self, dense=8, dim=8, tables=((20, "sum"), (30, "mean"), (12, "sum")),
                 classes=2, hidden=16):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, hidden), nn.ReLU(), nn.Linear(hidden, dim),
                                    nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode=mode) for rows, mode in tables)
        features = len(tables) + 1
        pairs = features * (features - 1) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))
        rows, cols = torch.tril_indices(features, features, offset=-1)
        self.register_buffer("pair_rows", rows, persistent=False)  # constants: IR constants
        self.register_buffer("pair_cols", cols, persistent=False)

    def forward(self, dense, indices, offsets):
        x = self.bottom(dense)
        bags = [table(indices[t], offsets[t]) for t, table in enumerate(self.tables)]
        vectors = torch.stack([x] + bags, dim=1)  # (batch, features, dim)
        z = torch.bmm(vectors, vectors.transpose(1, 2))
        interactions = z[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat([x, interactions], dim=1))


def make_dlrm(batch, seed=0, bag_items=3, **sizes):
    """(module, (dense, indices, offsets), target): ``DLRM(**sizes)`` with random initial
    values and a batch whose bags hold ``bag_items`` items on average (lengths vary, empty bags
    included)."""
    torch.manual_seed(seed)
    module = DLRM(**sizes)
    gen = torch.Generator().manual_seed(seed + 1)
    length = batch * bag_items
    indices = torch.stack([torch.randint(0, table.num_embeddings, (length,), generator=gen)
                           for table in module.tables])
    cuts = [torch.sort(torch.randint(0, length + 1, (batch - 1,), generator=gen)).values
            for _ in module.tables]
    offsets = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), c]) for c in cuts])
    dense = torch.randn(batch, module.bottom[0].in_features, generator=gen)
    return module, (dense, indices, offsets), torch.randint(0, 2, (batch,), generator=gen)


class ShardedRec(nn.Module):
    """A DLRM-style recommender whose inputs all lead with the batch (what data parallelism
    splits), for embedding-table parallelism: a bottom MLP on the dense features; three
    ``nn.EmbeddingBag`` tables of different sizes looked up with bags of ``bag`` ids per sample
    (a sum bag with per-sample weights, a mean bag whose padding id 0 shortens some bags, a
    plain sum bag) and one ``nn.Embedding`` of a categorical feature; the pairwise dot
    products of the vectors (DLRM's interactions); a top MLP.
    ``forward(dense (B, F), ids (B, 3, bag), category (B,), weights (B, bag))``."""

    def __init__(self, dense=8, dim=8, rows=(40, 60, 12), categories=25, classes=2, hidden=16):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, hidden), nn.ReLU(), nn.Linear(hidden, dim),
                                    nn.ReLU())
        self.tables = nn.ModuleList([nn.EmbeddingBag(rows[0], dim, mode="sum"),
                                     nn.EmbeddingBag(rows[1], dim, mode="mean", padding_idx=0),
                                     nn.EmbeddingBag(rows[2], dim, mode="sum")])
        self.category = nn.Embedding(categories, dim)
        features = len(rows) + 2
        pairs = features * (features - 1) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))
        r, c = torch.tril_indices(features, features, offset=-1)
        self.register_buffer("pair_rows", r, persistent=False)
        self.register_buffer("pair_cols", c, persistent=False)

    def forward(self, dense, ids, category, weights):
        x = self.bottom(dense)
        bags = [self.tables[0](ids[:, 0], per_sample_weights=weights),
                self.tables[1](ids[:, 1]), self.tables[2](ids[:, 2])]
        vectors = torch.stack([x, *bags, self.category(category)], dim=1)
        z = torch.bmm(vectors, vectors.transpose(1, 2))
        return self.top(torch.cat([x, z[:, self.pair_rows, self.pair_cols]], dim=1))


def make_sharded_rec(batch, seed=0, bag=4):
    """(module, (dense, ids, category, weights), target) for ShardedRec: random initial
    values, ids uniform over each table (the mean bag's padding id 0 included, so its bags
    have different lengths)."""
    torch.manual_seed(seed)
    module = ShardedRec()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randint(0, t.num_embeddings, (batch, bag), generator=gen)
                       for t in module.tables], dim=1)
    inputs = (torch.randn(batch, module.bottom[0].in_features, generator=gen), ids,
              torch.randint(0, module.category.num_embeddings, (batch,), generator=gen),
              torch.rand(batch, bag, generator=gen))
    return module, inputs, torch.randint(0, 2, (batch,), generator=gen)
