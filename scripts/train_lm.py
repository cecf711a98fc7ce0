"""Train a byte-level GPT on the Python standard library's own source: the end-to-end recipe.

    mpirun -np 2 python scripts/train_lm.py --steps 300
    python -m raf_dist.run --nproc-per-node 2 scripts/train_lm.py --tp 2 --steps 300
    mpirun -np 4 python scripts/train_lm.py --pp 2 --zero 1 --microbatches 2 --resume

The corpus is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (no download),
read as bytes (vocabulary 256) and split into training and validation *by file* (every 10th
file validates). Each step draws its global batch of windows from a generator seeded by the
step, so a resumed run sees exactly the batches it would have seen. The model is nanoGPT's
shape (``--model nanogpt``: token and position embeddings, pre-norm blocks of causal
self-attention and a GELU MLP, the head tied to the token embedding) or a transformers model
built from its config by name (``--model hf:gpt2`` / ``hf:llama``, sized by the same flags).

What it shows of raf_dist: any mesh from flags (``--tp``, ``--pp``, the rest data parallel,
``--zero``, ``--microbatches``), AdamW with no weight decay on biases, norms and
embeddings' positions, warm-up + cosine, clipping at ``--max-grad-norm``, a tqdm line with
loss, tokens/s and MFU (``Trainer.metrics()``), validation every ``--val-every`` steps
(``Trainer.predict``), checkpoints every ``--ckpt-every`` steps and ``--resume``, a loss-curve
PNG and a JSON history, and a few sampled lines at the end. A transformers model's
checkpoint records its config, so ``python -m raf_dist.tools.export_hf CKPT OUT`` writes a
directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""
import argparse
import fnmatch
import json
import logging
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import raf_dist
from raf_dist import distributed as dist

VOCAB = 256  # bytes
NO_DECAY = ["*.bias", "*ln*", "*norm*", "*pos*"]


class Block(nn.Module):
    def __init__(self, dim, heads, seq):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(~self.mask[:seq, :seq], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """nanoGPT's model at a size this CPU trains in minutes; logits flattened to
    (batch * seq, vocab) as nanoGPT's loss reads them."""

    def __init__(self, layers, heads, dim, seq):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, seq) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return logits.reshape(-1, logits.shape[-1])


class LogitsOnly(nn.Module):
    """A transformers causal LM as ``input_ids -> flat logits``; ``model.`` prefixes its names."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        logits = self.model(idx).logits
        return logits.reshape(-1, logits.shape[-1])


def build_model(args):
    """(torch module, {"class", "config", "prefix"} for a transformers model, else None)."""
    torch.manual_seed(args.seed)
    if args.model == "nanogpt":
        return GPT(args.layers, args.heads, args.dim, args.seq), None
    import transformers
    name = args.model.split(":", 1)[1]
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=args.dim,
                                         n_layer=args.layers, n_head=args.heads,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    elif name == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=args.dim,
                                          intermediate_size=4 * args.dim,
                                          num_hidden_layers=args.layers,
                                          num_attention_heads=args.heads,
                                          max_position_embeddings=args.seq,
                                          tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise SystemExit(f"--model {args.model!r}: use nanogpt, hf:gpt2 or hf:llama")
    hf = {"class": type(model).__name__, "config": config.to_dict(), "prefix": "model."}
    return LogitsOnly(model), hf


def corpus(max_bytes):
    """(train bytes, validation bytes) of the standard library's .py files, split by file."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    train, val, total = [], [], 0
    for i, path in enumerate(files):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        (val if i % 10 == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return (np.frombuffer(b"\n".join(train), np.uint8),
            np.frombuffer(b"\n".join(val), np.uint8))


def windows(data, rows, seq, seed):
    """``rows`` random windows of ``seq`` + 1 bytes: (inputs, next bytes)."""
    starts = np.random.default_rng(seed).integers(0, len(data) - seq - 1, rows)
    chunk = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)
    return chunk[:, :-1], chunk[:, 1:]


def cross_entropy(logits, targets):
    logits = logits.astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean())


def sample(trainer, prompt, tokens, seq, temperature, seed):
    """Bytes generated after ``prompt`` (every rank calls: predict may gather)."""
    rng = np.random.default_rng(seed)
    out = list(prompt.encode())
    for _ in range(tokens):
        context = ([ord(" ")] * seq + out)[-seq:]  # left-padded: the next byte is the last row's
        logits = trainer.predict(np.array([context], np.int64)).reshape(seq, VOCAB)[-1]
        logits = logits.astype(np.float64) / temperature
        probs = np.exp(logits - logits.max())
        out.append(int(rng.choice(VOCAB, p=probs / probs.sum())))
    return bytes(out).decode("utf-8", errors="replace")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nanogpt", help="nanogpt | hf:gpt2 | hf:llama")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    p.add_argument("--steps", type=int, default=1000, help="the run's length (the schedule's)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step (checkpointed; continue with --resume)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--val-rows", type=int, default=64)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir's latest")
    p.add_argument("--corpus-mb", type=float, default=8.0)
    p.add_argument("--out", default="train_lm_out", help="curve PNG and history JSON here")
    p.add_argument("--sample", type=int, default=200, help="bytes to sample at the end")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    comm = dist.get_communicator()
    dp = comm.size // (args.tp * args.pp)
    if dp * args.tp * args.pp != comm.size or args.batch % dp:
        raise SystemExit(f"{comm.size} ranks do not divide into tp {args.tp} x pp {args.pp} "
                         f"x dp, or the batch {args.batch} into dp {dp}")
    dist.get_config().update({
        "tensor_parallel_size": args.tp, "pipeline_parallel_size": args.pp,
        "enable_data_parallel": dp > 1 or args.zero > 0, "zero_opt_level": args.zero,
        "num_microbatches": args.microbatches})
    mesh = dist.get_mesh() if comm.size > 1 else None
    dp_rank = mesh.dp_rank if mesh is not None else 0
    local = args.batch // dp
    mine = slice(dp_rank * local, (dp_rank + 1) * local)

    train_data, val_data = corpus(int(args.corpus_mb * 2 ** 20))
    module, hf = build_model(args)
    x0, _ = windows(train_data, local, args.seq, 0)
    model = raf_dist.frontend.from_pytorch(module, (torch.from_numpy(x0),))
    # no weight decay on biases, norms and positions: the patterns this model has a name for
    present = [p for p in NO_DECAY if any(fnmatch.fnmatchcase(n, p) for n in model.param_names)]
    optimizer = raf_dist.optim.AdamW(
        lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
        param_groups=[{"params": present, "weight_decay": 0.0}] if present else None)
    trainer = raf_dist.Trainer(
        model, optimizer=optimizer, precision=args.precision, max_grad_norm=args.max_grad_norm,
        lr_schedule=raf_dist.optim.schedules.warmup_cosine(min(args.warmup, args.steps), args.steps,
                                                          args.min_lr_ratio),
        seed=args.seed)
    history = {"train": [], "val": [], "args": vars(args)}
    out = Path(args.out)
    if args.resume:
        if not args.ckpt_dir:
            raise SystemExit("--resume needs --ckpt-dir")
        extra = trainer.load_checkpoint(args.ckpt_dir)
        history = extra.get("history", history)
    start = trainer.step_count
    val_x, val_y = windows(val_data, args.val_rows, args.seq, 10 ** 6)

    def validate():
        logits = trainer.predict(val_x).reshape(-1, VOCAB)
        return cross_entropy(logits, val_y.reshape(-1))

    from tqdm import tqdm
    end = min(args.steps, args.stop_at or args.steps)
    bar = tqdm(range(start, end), initial=start, total=args.steps,
               disable=comm.rank != 0, dynamic_ncols=True)
    began = time.perf_counter()
    for step in bar:
        x, y = windows(train_data, args.batch, args.seq, args.seed * 10 ** 6 + step + 1)
        loss = trainer.step(x[mine], y[mine].reshape(-1))
        m = trainer.metrics()
        history["train"].append([step + 1, loss])
        bar.set_postfix_str(f"loss {loss:.3f} lr {m['lr']:.2e} tok/s {m['tokens_per_s']:.0f} "
                            f"MFU {m['mfu']:.1%}")
        if args.val_every and ((step + 1) % args.val_every == 0 or step + 1 == end):
            history["val"].append([step + 1, validate()])
            if comm.rank == 0:
                bar.write(f"step {step + 1}: validation loss {history['val'][-1][1]:.4f}")
        if args.ckpt_dir and args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            trainer.save_checkpoint(args.ckpt_dir, extra={"history": history, "hf": hf})
    bar.close()
    if args.ckpt_dir:
        trainer.save_checkpoint(args.ckpt_dir, extra={"history": history, "hf": hf})
    text = sample(trainer, "def ", args.sample, args.seq, 0.8, args.seed) if args.sample else ""
    if comm.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "history.json").write_text(json.dumps(history))
        plot(history, out / "loss.png")
        print(f"trained steps {start}..{end} in {time.perf_counter() - began:.1f} s; "
              f"final validation loss {history['val'][-1][1] if history['val'] else float('nan'):.4f}"
              f" (uniform bytes: {math.log(VOCAB):.4f})")
        if text:
            print("sampled:\n" + text)
    return history


def plot(history, path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = zip(*history["train"]) if history["train"] else ((), ())
    ax.plot(steps, losses, lw=0.8, alpha=0.6, label="train (global batch)")
    if history["val"]:
        vs, vl = zip(*history["val"])
        ax.plot(vs, vl, "o-", label="validation")
    ax.axhline(math.log(VOCAB), color="gray", ls=":", label="uniform bytes")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
