"""Mixed precision: raf_dist bf16 vs PyTorch's ``torch.autocast(device, dtype=torch.bfloat16)``,
and both against their float32 selves, each side alone (DESIGN.md section 6).

    python bench/mixed_precision.py [--model gpt|gemm_gpt|all] [--steps 8] [--rounds 3]
                                    [--cores K] [--device cpu|cuda] [--peer eager|compile]

Models (AdamW): ``gpt`` is bench/step_time.py's GPT (4 layers, d=128, seq 64, vocab 512,
batch 16); ``gemm_gpt`` the issue's GEMM-dominated GPT (6 layers, d=512, 8 heads, seq 128,
vocab 4096, batch 8; 23M parameters); ``gpt2_124m`` / ``llama_124m`` the issue's table:
transformers GPT-2 (default config) and a Llama (12 layers, d=768, GQA 12/4, vocab 32000),
batch 4 x 128 tokens, dropout off. ``all`` is the first two. Four sides, each in a
process of its own with its own defaults, alternating for ``--rounds`` rounds: raf_dist
fp32, raf_dist bf16, PyTorch fp32, PyTorch autocast bf16 (forward and loss under autocast,
as PyTorch's AMP recipe). Printed:
each side's median step time; the ratios raf bf16 / torch autocast and raf bf16 / raf fp32
(median of the per-round ratios [spread]); raf_dist's planned step temporaries in bf16 over
fp32; the bf16 GEMM path raf_dist measured on this machine (``RAF_DIST_LOW_GEMM``).

    python bench/mixed_precision.py --side raf|torch --precision fp32|bf16 --model gpt
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if "--side" in sys.argv and sys.argv[sys.argv.index("--side") + 1:][:1] == ["raf"]:
    # a raf_dist side imports raf_dist before torch, as README asks: it sets its own process's
    # OpenMP wait policy before torch's libgomp loads (raf_dist.env); the PyTorch sides never
    # import raf_dist and keep PyTorch's defaults
    import raf_dist  # noqa: F401

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from step_time import GPT  # noqa: E402

SHAPES = {  # name: (GPT kwargs, batch); the 124M models: (None, batch), built by make()
    "gpt": (dict(vocab=512, d=128, heads=4, layers=4, seq=64), 16),
    "gemm_gpt": (dict(vocab=4096, d=512, heads=8, layers=6, seq=128), 8),
    "gpt2_124m": (None, 4),
    "llama_124m": (None, 4),
}
SEQ_124M = 128


def _transformers_model(name):
    """The issue's 124M models (transformers, dropout off as bench/models.py): GPT-2's
    default config; a Llama of 12 layers, d=768, 12 heads / 4 KV heads, vocab 32000."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from hf import LogitsOnly, import_transformers

    transformers = import_transformers()
    if name == "gpt2_124m":
        config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return LogitsOnly(transformers.GPT2LMHeadModel(config)), config.vocab_size
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=768,
                                      intermediate_size=2048, num_hidden_layers=12,
                                      num_attention_heads=12, num_key_value_heads=4,
                                      max_position_embeddings=SEQ_124M)
    return LogitsOnly(transformers.LlamaForCausalLM(config)), config.vocab_size


def make(name):
    torch.manual_seed(0)
    kwargs, batch = SHAPES[name]
    if kwargs is None:
        module, vocab = _transformers_model(name)
        x = torch.randint(0, vocab, (batch, SEQ_124M))
        y = torch.randint(0, vocab, (batch, SEQ_124M))
        return module, x, y
    module = GPT(**kwargs)
    x = torch.randint(0, kwargs["vocab"], (batch, kwargs["seq"]))
    y = torch.randint(0, kwargs["vocab"], (batch, kwargs["seq"]))
    return module, x, y


def raf_side(name, precision, steps, cache_dir, device="cpu"):
    import raf_dist
    from raf_dist.runtime import blas

    module, x, y = make(name)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir,
                               precision=precision, device=device)
    xn, yn = x.numpy(), y.numpy()
    ms = harness.median_ms(lambda: trainer.step(xn, yn), steps)
    low_gemm = blas.low_gemm_mode("bfloat16") if precision == "bf16" and device == "cpu" else ""
    return {"ms": ms, "planned_peak_bytes": trainer.stats()["planned_peak_bytes"],
            "low_gemm": low_gemm}


def torch_side(name, precision, steps, device="cpu", peer="eager"):
    module, x, y = make(name)
    module, x, y = module.to(device), x.to(device), y.to(device)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def loss_of(m):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = m(x)
            return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))

    train, _, first_s = harness.torch_peer_step(module, opt, loss_of, peer)

    def step():
        train()
        sync()

    return {"ms": harness.median_ms(step, steps), "threads": torch.get_num_threads(),
            "first_step_s": first_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=[*SHAPES, "all"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: both frameworks on GPU 0 (needs a CUDA build of PyTorch)")
    parser.add_argument("--peer", default="eager", choices=harness.PEERS,
                        help="PyTorch eager (default) or torch.compile (Inductor) under autocast")
    parser.add_argument("--side", choices=["raf", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "raf":
        return harness.report(raf_side(args.model, args.precision, args.steps, args.cache_dir,
                                       args.device))
    if args.side == "torch":
        return harness.report(torch_side(args.model, args.precision, args.steps, args.device,
                                         args.peer))

    names = ["gpt", "gemm_gpt"] if args.model == "all" else [args.model]
    cpu_set = harness.cores(args.cores)
    print(f"# torch {torch.__version__} on {args.device}; {harness.machine()}; each side alone, {args.rounds} "
          f"alternating rounds of {args.steps} steps; AdamW; peer: PyTorch {args.peer}")
    print(f"{'model':9s} {'raf fp32':>9s} {'raf bf16':>9s} {'torch fp32':>10s} "
          f"{'torch amp':>9s} {'bf16/amp [spread]':>18s} {'bf16/fp32 [spread]':>19s} "
          f"{'temps bf16/fp32':>15s} {'bf16 GEMM':>9s}")
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in names:
            common = [sys.executable, __file__, "--model", name, "--steps", str(args.steps),
                      "--device", args.device]
            sides = {f"{side}_{p}": common + ["--side", side, "--precision", p]
                     + (["--cache-dir", cache_dir] if side == "raf" else ["--peer", args.peer])
                     for side in ("raf", "torch") for p in ("fp32", "bf16")}
            res = harness.alternate(sides, args.rounds, cpu_set)
            ms = {k: [r["ms"] for r in v] for k, v in res.items()}
            temps = res["raf_bf16"][0]["planned_peak_bytes"] / res["raf_fp32"][0][
                "planned_peak_bytes"]
            print(f"{name:9s} {statistics.median(ms['raf_fp32']):9.1f} "
                  f"{statistics.median(ms['raf_bf16']):9.1f} "
                  f"{statistics.median(ms['torch_fp32']):10.1f} "
                  f"{statistics.median(ms['torch_bf16']):9.1f} "
                  f"{harness.format_ratio(ms['raf_bf16'], ms['torch_bf16']):>18s} "
                  f"{harness.format_ratio(ms['raf_bf16'], ms['raf_fp32']):>19s} "
                  f"{temps:15.2f} {res['raf_bf16'][0]['low_gemm']:>9s}")


if __name__ == "__main__":
    main()
