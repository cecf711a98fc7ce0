"""Training-step time: raf_dist (compiled Relax step) vs PyTorch eager, same process.

    python bench/step_time.py [--model mlp|gpt|all] [--steps 20] [--threads 2] [--device cuda]

Models (AdamW): MLP 784-1024-1024-10, batch 128; GPT-style 4 layers, d=128, 4 heads, seq 64,
vocab 512, batch 16. The two frameworks run alternately on identical data and initial
weights; the table gives median step times, their ratio (raf_dist / PyTorch, < 1 is faster)
and raf_dist's compile time (cold cache).
"""
import os

# Idle OpenMP workers (PyTorch) wait passively, as raf_dist's TVM pool does by default, so that
# neither framework's spinning threads steal the 2 cores from the other between alternating steps.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import raf_dist


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        batch, seq, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(batch, seq, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=512, d=128, heads=4, layers=4, seq=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make(name):
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), torch.randn(128, 784), torch.randint(0, 10, (128,))
    return GPT(), torch.randint(0, 512, (16, 64)), torch.randint(0, 512, (16, 64))


def torch_step(module, opt, x, y):
    """One PyTorch training step (cross-entropy over every position), as raf_dist's."""
    opt.zero_grad(set_to_none=True)
    out = module(x)
    F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    opt.step()


def bench(name, steps, cache_dir, device="cpu"):
    module, x, y = make(name)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    start = time.perf_counter()
    trainer = raf_dist.Trainer(model, loss="cross_entropy",
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir,
                               device=device)
    compile_s = time.perf_counter() - start
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    module, tx, ty = module.to(device), x.to(device), y.to(device)  # PyTorch on the same device
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    xn, yn = x.numpy(), y.numpy()  # raf_dist takes host batches and copies them over
    for _ in range(3):  # warm up both
        trainer.step(xn, yn)
        torch_step(module, opt, tx, ty)
    sync()
    raf_times, torch_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.step(xn, yn)  # returns the loss as a float: the step has finished
        t1 = time.perf_counter()
        torch_step(module, opt, tx, ty)
        sync()
        t2 = time.perf_counter()
        raf_times.append(t1 - t0)
        torch_times.append(t2 - t1)
    raf_ms, torch_ms = statistics.median(raf_times) * 1e3, statistics.median(torch_times) * 1e3
    return raf_ms, torch_ms, compile_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=["mlp", "gpt", "all"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: both frameworks on GPU 0 (needs a CUDA build of PyTorch)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = ["mlp", "gpt"] if args.model == "all" else [args.model]
    print(f"# torch {torch.__version__} on {args.device}, {args.threads} threads; median of "
          f"{args.steps} alternating steps; AdamW")
    print(f"{'model':6s} {'raf_dist ms':>12s} {'torch ms':>9s} {'ratio':>6s} {'compile s':>10s}")
    with tempfile.TemporaryDirectory() as cache_dir:  # cold cache: the compile time is real
        for name in names:
            raf_ms, torch_ms, compile_s = bench(name, args.steps, cache_dir, args.device)
            print(f"{name:6s} {raf_ms:12.2f} {torch_ms:9.2f} {raf_ms / torch_ms:6.2f} {compile_s:10.2f}")


if __name__ == "__main__":
    main()
