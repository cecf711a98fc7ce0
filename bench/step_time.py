"""Training-step time: raf_dist (compiled Relax step) vs PyTorch eager, each alone.

    python bench/step_time.py [--model mlp|gpt|all] [--steps 20] [--rounds 3] [--cores K]
                              [--device cpu|cuda] [--peer eager|compile]

Models (AdamW): MLP 784-1024-1024-10, batch 128; GPT-style 4 layers, d=128, 4 heads, seq 64,
vocab 512, batch 16. Each side runs in a process of its own with its own defaults (bench/
harness.py), on the same cores (all the driver may use, or the first K), identical data and
initial weights; the sides alternate for ``--rounds`` rounds. Printed: each side's median step
time over the rounds, the median of the per-round ratios raf_dist / PyTorch (< 1: raf_dist is
faster) with their spread, and raf_dist's compile time in the first round (cold cache).

    python bench/step_time.py --side raf|torch --model mlp    one side, one BENCH line
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


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


def gpt():
    """(module, input, target) of the GPT (a MODEL_SPEC for raf_dist.tools.explain_plan)."""
    return make("gpt")


def torch_step(module, opt, x, y):
    """One PyTorch training step (cross-entropy over every position), as raf_dist's."""
    opt.zero_grad(set_to_none=True)
    out = module(x)
    F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    opt.step()


def raf_side(name, steps, cache_dir, device="cpu"):
    """raf_dist alone: compile (timed) then the median step."""
    import raf_dist

    module, x, y = make(name)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    start = time.perf_counter()
    trainer = raf_dist.Trainer(model, loss="cross_entropy",
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir,
                               device=device)
    compile_s = time.perf_counter() - start
    xn, yn = x.numpy(), y.numpy()  # raf_dist takes host batches (and copies them to a GPU)
    # step() returns the loss as a float: the step has finished when it returns
    ms = harness.median_ms(lambda: trainer.step(xn, yn), steps)
    return {"ms": ms, "compile_s": compile_s}


def torch_side(name, steps, device="cpu", peer="eager"):
    """PyTorch alone (eager, or torch.compile on the module and the optimizer's step), on its
    default thread settings."""
    module, x, y = make(name)
    module, x, y = module.to(device), x.to(device), y.to(device)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def loss_of(m):
        out = m(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    train, _, first_s = harness.torch_peer_step(module, opt, loss_of, peer)

    def step():
        train()
        sync()

    return {"ms": harness.median_ms(step, steps), "threads": torch.get_num_threads(),
            "compile_s": first_s if peer == "compile" else 0.0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=["mlp", "gpt", "all"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=None,
                        help="run both sides on the first K cores (default: all)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: both frameworks on GPU 0 (needs a CUDA build of PyTorch)")
    parser.add_argument("--peer", default="eager", choices=harness.PEERS,
                        help="PyTorch eager (default) or torch.compile (Inductor)")
    parser.add_argument("--side", choices=["raf", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "raf":
        return harness.report(raf_side(args.model, args.steps, args.cache_dir, args.device))
    if args.side == "torch":
        return harness.report(torch_side(args.model, args.steps, args.device, args.peer))

    names = ["mlp", "gpt"] if args.model == "all" else [args.model]
    cpu_set = harness.cores(args.cores)
    print(f"# torch {torch.__version__} on {args.device}; {harness.machine()}; each side alone, "
          f"{args.rounds} alternating rounds of {args.steps} steps; AdamW; peer: PyTorch "
          f"{args.peer}")
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:  # cold in round 1: the compile time is real
        for name in names:
            common = [sys.executable, __file__, "--model", name, "--steps", str(args.steps),
                      "--device", args.device]
            sides = {"raf": common + ["--side", "raf", "--cache-dir", cache_dir],
                     "torch": common + ["--side", "torch", "--peer", args.peer]}
            results = harness.alternate(sides, args.rounds, cpu_set)
            rows.append((name, results))
    print(f"{'model':6s} {'raf_dist ms':>12s} {'torch ms':>9s} {'ratio [spread]':>16s} "
          f"{'compile s':>10s} {'torch compile s':>15s} {'torch threads':>13s}")
    for name, results in rows:
        raf = [r["ms"] for r in results["raf"]]
        peer = [r["ms"] for r in results["torch"]]
        print(f"{name:6s} {statistics.median(raf):12.2f} {statistics.median(peer):9.2f} "
              f"{harness.format_ratio(raf, peer):>16s} {results['raf'][0]['compile_s']:10.2f} "
              f"{results['torch'][0]['compile_s']:15.2f} {results['torch'][0]['threads']:13d}")


if __name__ == "__main__":
    main()
