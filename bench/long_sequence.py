"""Long sequences: peak memory and step time of raf_dist vs PyTorch eager, each alone.

    python bench/long_sequence.py [--seqs 1024,2048,4096] [--precision fp32|bf16]
                                  [--peer eager|compile]
                                  [--steps 3] [--rounds 3] [--plot bench/long_sequence.png]
    python bench/long_sequence.py --side raf --seq 16384 --steps 1     one side, one line
    python bench/long_sequence.py --cp 2 --seqs 8192 [--method ring|alltoall]

``--cp C``: context parallelism, raf_dist against itself: one process at each length against
``mpiexec -n C`` ranks with context_parallel_size=C (each rank bound to one core; the job's
peak is its largest rank's VmHWM), the issue's target a per-rank peak <= 0.6x the
one-process peak at 8192.

The model (issue #64's): a Llama-like LM written with F.scaled_dot_product_attention
(is_causal=True): vocab 2048, d 256, 4 layers, 4 heads, RMSNorm, SwiGLU, batch 2, AdamW.
``--peer compile``: PyTorch's side is torch.compile (Inductor) on the module and on the
optimizer's step, its first (compiling) step outside the timing. Each side runs in a process of its own with its own defaults (bench/harness.py); the sides
alternate for ``--rounds`` rounds. Memory is the process's peak resident set (VmHWM: import,
capture and compile included, what a user must have); time the median step (after 2 warm-up
steps), the ratio the median over rounds of the per-round ratio raf_dist / PyTorch (< 1:
raf_dist is faster or smaller). bf16: raf_dist's Trainer(precision="bf16") against
PyTorch's CPU autocast (bf16) around forward and loss, its AMP recipe.
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

VOCAB, D, LAYERS, HEADS, BATCH = 2048, 256, 4, 4, 2


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        hidden = 4 * d
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(D, HEADS) for _ in range(LAYERS))
        self.norm = RMSNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make(seq):
    torch.manual_seed(0)
    return (LM(), torch.randint(0, VOCAB, (BATCH, seq)), torch.randint(0, VOCAB, (BATCH, seq)))


def peak_rss_mib():
    """This process's peak resident set (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def raf_side(seq, steps, precision, cache_dir, cp=1, method="ring"):
    import raf_dist
    from raf_dist import distributed as dist

    if cp > 1:  # every rank of the cp group passes the whole sequences
        dist.get_config().update({"context_parallel_size": cp,
                                  "context_parallel_method": method})
    module, x, y = make(seq)
    start = time.perf_counter()
    model = raf_dist.frontend.from_pytorch(module, (x,))
    del module
    trainer = raf_dist.Trainer(model, optimizer=raf_dist.optim.AdamW(lr=1e-3),
                               precision=precision, cache_dir=cache_dir)
    compile_s = time.perf_counter() - start
    xn, yn = x.numpy(), y.numpy()
    first = trainer.step(xn, yn)
    ms = harness.median_ms(lambda: trainer.step(xn, yn), steps, warmup=1)
    result = {"ms": ms, "peak_mib": peak_rss_mib(), "first_loss": first, "compile_s": compile_s}
    if cp > 1:  # the job's peak: its largest rank's
        peaks = dist.get_communicator().mpi_comm.allgather(result["peak_mib"])
        result.update(peak_mib=max(peaks), rank_peaks_mib=peaks)
        if dist.get_communicator().rank:
            return None
    return result


def torch_side(seq, steps, precision, peer):
    module, x, y = make(seq)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def loss_of(m):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return F.cross_entropy(m(x).reshape(-1, VOCAB), y.reshape(-1))

    step, first, first_s = harness.torch_peer_step(module, opt, loss_of, peer)
    ms = harness.median_ms(step, steps, warmup=1)
    return {"ms": ms, "peak_mib": peak_rss_mib(), "first_loss": first,
            "threads": torch.get_num_threads(), "first_step_s": first_s}


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = [seq for seq, _ in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for side, label in (("raf", "raf_dist"), ("torch", "PyTorch eager")):
        ax.plot(seqs, [statistics.median(r["peak_mib"] for r in res[side]) / 1024
                       for _, res in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("peak resident memory (GiB)")
    ax.set_title("Llama-like LM, batch 2: peak memory (VmHWM)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="1024,2048,4096")
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=None)
    parser.add_argument("--plot", help="write the memory-vs-seq plot here (matplotlib)")
    parser.add_argument("--peer", default="eager", choices=harness.PEERS,
                        help="PyTorch eager (default) or torch.compile (Inductor)")
    parser.add_argument("--side", choices=["raf", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, default=1,
                        help="context parallelism: one process vs C ranks of raf_dist")
    parser.add_argument("--method", default="ring", choices=["ring", "alltoall"])
    args = parser.parse_args()
    if args.side == "raf":
        result = raf_side(args.seq, args.steps, args.precision, args.cache_dir, args.cp,
                          args.method)
        return harness.report(result) if result is not None else None
    if args.side == "torch":
        return harness.report(torch_side(args.seq, args.steps, args.precision, args.peer))

    cpu_set = harness.cores(args.cores)
    print(f"# torch {torch.__version__}; {harness.machine()}; each side alone, {args.rounds} "
          f"alternating rounds of {args.steps} steps; {args.precision}; AdamW; batch {BATCH}; "
          f"peer: PyTorch {args.peer}")
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for seq in [int(s) for s in args.seqs.split(",")]:
            common = [sys.executable, __file__, "--seq", str(seq), "--steps", str(args.steps),
                      "--precision", args.precision]
            sides = {"raf": common + ["--side", "raf", "--cache-dir", cache_dir],
                     "torch": common + ["--side", "torch", "--peer", args.peer]}
            if args.cp > 1:  # the peer is raf_dist's own one-process run
                sides = {"raf": [harness.mpiexec(), "-n", str(args.cp), *harness.BIND]
                         + sides["raf"] + ["--cp", str(args.cp), "--method", args.method],
                         "torch": sides["raf"]}
            rows.append((seq, harness.alternate(sides, args.rounds, cpu_set)))
    if args.cp > 1:
        print(f"# cp {args.cp} ({args.method}): 'raf' is the cp job (its largest rank), "
              "'torch' raf_dist's one process")
    print(f"{'seq':>6s} {'raf GiB':>8s} {'torch GiB':>9s} {'memory ratio':>13s} "
          f"{'raf ms':>9s} {'torch ms':>9s} {'time ratio [spread]':>20s} {'first loss':>22s}")
    for seq, res in rows:
        raf_mem = [r["peak_mib"] for r in res["raf"]]
        peer_mem = [r["peak_mib"] for r in res["torch"]]
        raf_ms = [r["ms"] for r in res["raf"]]
        peer_ms = [r["ms"] for r in res["torch"]]
        print(f"{seq:6d} {statistics.median(raf_mem) / 1024:8.2f} "
              f"{statistics.median(peer_mem) / 1024:9.2f} "
              f"{harness.ratio_summary(raf_mem, peer_mem)[0]:13.2f} "
              f"{statistics.median(raf_ms):9.1f} {statistics.median(peer_ms):9.1f} "
              f"{harness.format_ratio(raf_ms, peer_ms):>20s} "
              f"{res['raf'][0]['first_loss']:10.6f}/{res['torch'][0]['first_loss']:.6f}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
