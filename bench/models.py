"""Training-step time of real models: raf_dist (compiled Relax step) vs PyTorch eager, each alone.

    python bench/models.py [--model gpt2|llama|resnet|vit|dlrm|all] [--steps 10] [--rounds 3]
                           [--cores K] [--profile-steps 3]

Models (AdamW, cross-entropy, random initial values from seed 0, the same data both sides):
  gpt2    transformers GPT2LMHeadModel: 4 layers, d=128, 4 heads, vocab 2048, dropout off;
          batch 8 x seq 64
  llama   transformers LlamaForCausalLM: 4 layers, d=128, 4 heads (2 KV heads), MLP 352,
          vocab 2048; batch 8 x seq 64
  resnet  torchvision ResNet(BasicBlock, [1, 1, 1, 1]) (ResNet-10), 10 classes; batch 32 x 3x32x32
  vit     torchvision VisionTransformer: image 32, patch 4, 4 layers, d=128, 4 heads, MLP 256;
          batch 32
  dlrm    tests/models.py DLRM: 13 dense features, 8 EmbeddingBag tables of 10000 x 32 (sum
          and mean), MLPs 256 wide; batch 256, 4 items per bag on average
Each side runs in a process of its own with its own defaults (bench/harness.py), on the same
cores, and the sides alternate for ``--rounds`` rounds. Printed per model: each side's median
step time over the rounds, the median per-round ratio raf_dist / PyTorch (< 1: raf_dist is
faster) with its spread, raf_dist's compile time (first round, cold cache), and raf_dist's
slowest operator: the callee (with its operand shapes for a BLAS call) with the most time in
``--profile-steps`` steps recorded with Trainer.profile after the timed ones (the VM's own
builtins left out), per step and as a share of the step time (the profiler adds a few µs per
call: raf_dist.profiler).

    python bench/models.py --side raf|torch --model resnet    one side, one BENCH line
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))  # tests/models.py (DLRM), vision.py, hf.py
import harness  # noqa: E402

MODELS = ["gpt2", "llama", "resnet", "vit", "dlrm"]


def make(name):
    """(module, inputs tuple, target) with seed-0 initial values and data."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name in ("gpt2", "llama"):
        from hf import LogitsOnly, import_transformers  # tests/hf.py: logits out, no torchvision

        transformers = import_transformers()
        if name == "gpt2":  # dropout off, as tests/hf.py (the two sides' masks differ anyway)
            config = transformers.GPT2Config(vocab_size=2048, n_positions=64, n_embd=128,
                                             n_layer=4, n_head=4, resid_pdrop=0.0,
                                             embd_pdrop=0.0, attn_pdrop=0.0)
            module = LogitsOnly(transformers.GPT2LMHeadModel(config))
        else:
            config = transformers.LlamaConfig(vocab_size=2048, hidden_size=128,
                                              intermediate_size=352, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64)
            module = LogitsOnly(transformers.LlamaForCausalLM(config))
        ids = torch.randint(0, 2048, (8, 64), generator=gen)
        return module, (ids,), torch.randint(0, 2048, (8, 64), generator=gen)
    if name == "dlrm":
        from models import make_dlrm

        tables = tuple((10000, "sum" if t % 2 == 0 else "mean") for t in range(8))
        return make_dlrm(256, bag_items=4, dense=13, dim=32, tables=tables, hidden=256)
    from vision import import_torchvision_models

    models = import_torchvision_models()
    torch.manual_seed(0)
    if name == "resnet":
        module = models.resnet.ResNet(models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)
    else:
        module = models.VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4,
                                          hidden_dim=128, mlp_dim=256, num_classes=10)
    x = torch.randn(32, 3, 32, 32, generator=gen)
    return module, (x,), torch.randint(0, 10, (32,), generator=gen)


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def slowest_operator(trace_dir):
    """The operator with the most time in the recorded steps: calls grouped by callee and, for
    BLAS calls, operand shapes (``raf_dist.blas.matmul`` covers every matmul of the model; the
    shapes say which one), as the traces of Trainer.profile record them. The VM's builtins
    (allocation, shape checks) are bookkeeping, not operators. Time per step and share of the
    step time."""
    from collections import defaultdict

    from raf_dist.tools.timeline import load_traces

    totals = defaultdict(lambda: [0, 0.0])  # (name, shapes) -> [calls, microseconds]
    step_us, steps = 0.0, 0
    for events in load_traces(trace_dir).values():
        for event in events:
            if event["cat"] == "step":
                step_us += event["dur"]
                steps += 1
            elif event["cat"] != "vm":
                shapes = (event.get("args") or {}).get("shapes")
                entry = totals[(event["name"], json.dumps(shapes) if shapes else "")]
                entry[0] += 1
                entry[1] += event["dur"]
    if not totals or not steps:
        return None
    (name, shapes), (calls, us) = max(totals.items(), key=lambda item: item[1][1])
    return {"name": name, "shapes": json.loads(shapes) if shapes else None,
            "calls_per_step": calls / steps, "ms_per_step": us / steps / 1000.0,
            "share": round(us / step_us, 3)}


def raf_side(name, steps, profile_steps, cache_dir):
    """raf_dist alone: compile (timed), the median step, then a few profiled steps."""
    import raf_dist

    module, inputs, y = make(name)
    model = raf_dist.frontend.from_pytorch(module, inputs)
    start = time.perf_counter()
    trainer = raf_dist.Trainer(model, loss="cross_entropy",
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)
    compile_s = time.perf_counter() - start
    host, yn = tuple(t.numpy() for t in inputs), y.numpy()
    # step() returns the loss as a float: the step has finished when it returns
    ms = harness.median_ms(lambda: trainer.step(host, yn), steps)
    with tempfile.TemporaryDirectory() as trace_dir:  # after the timing: it costs per call
        trainer.profile(profile_steps, trace_dir)
        for _ in range(profile_steps):
            trainer.step(host, yn)
        slowest = slowest_operator(trace_dir)
    return {"ms": ms, "compile_s": compile_s, "slowest": slowest}


def torch_side(name, steps):
    """PyTorch eager alone, on its default thread settings."""
    module, inputs, y = make(name)
    module.train()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        _loss(module(*inputs), y).backward()
        opt.step()

    return {"ms": harness.median_ms(step, steps), "threads": torch.get_num_threads()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=MODELS + ["all"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--cores", type=int, default=None,
                        help="run both sides on the first K cores (default: all)")
    parser.add_argument("--side", choices=["raf", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "raf":
        return harness.report(raf_side(args.model, args.steps, args.profile_steps,
                                       args.cache_dir))
    if args.side == "torch":
        return harness.report(torch_side(args.model, args.steps))

    names = MODELS if args.model == "all" else [args.model]
    cpu_set = harness.cores(args.cores)
    print(f"# torch {torch.__version__} on cpu; {harness.machine()}; each side alone, "
          f"{args.rounds} alternating rounds of {args.steps} steps; AdamW")
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:  # cold in round 1: the compile time is real
        for name in names:
            common = [sys.executable, __file__, "--model", name, "--steps", str(args.steps),
                      "--profile-steps", str(args.profile_steps)]
            sides = {"raf": common + ["--side", "raf", "--cache-dir", cache_dir],
                     "torch": common + ["--side", "torch"]}
            rows.append((name, harness.alternate(sides, args.rounds, cpu_set)))
    print(f"{'model':7s} {'raf_dist ms':>12s} {'torch ms':>9s} {'ratio [spread]':>16s} "
          f"{'compile s':>10s}  slowest raf_dist operator (operand shapes)")
    for name, results in rows:
        raf = [r["ms"] for r in results["raf"]]
        peer = [r["ms"] for r in results["torch"]]
        slowest = results["raf"][-1]["slowest"]
        where = "-"
        if slowest:
            shapes = " x ".join("x".join(map(str, shape)) for shape in slowest["shapes"] or [])
            where = (f"{slowest['name']}{f' ({shapes})' if shapes else ''}: "
                     f"{slowest['ms_per_step']:.2f} ms/step in {slowest['calls_per_step']:g} "
                     f"calls, {100 * slowest['share']:.0f}%")
        print(f"{name:7s} {statistics.median(raf):12.2f} {statistics.median(peer):9.2f} "
              f"{harness.format_ratio(raf, peer):>16s} {results['raf'][0]['compile_s']:10.2f}  "
              f"{where}")


if __name__ == "__main__":
    main()
