"""Activation recomputation: planned step temporaries, step time and peak RSS of raf_dist's
step without recomputation, with ``activation_checkpointing="selective"`` and with ``"full"``,
each side alone (DESIGN.md section 6; the peer is raf_dist without recomputation, as the
targets of issue #31 are ratios against it).

    python bench/remat.py [--model gpt|gemm_gpt|all] [--steps 8] [--rounds 3] [--cores K]

Models (AdamW, float32): bench/mixed_precision.py's ``gpt`` (bench/step_time.py's GPT: 4
layers, d=128, seq 64, vocab 512, batch 16) and ``gemm_gpt`` (6 layers, d=512, 8 heads, seq
128, vocab 4096, batch 8; 23M parameters). Printed per model and policy: the median step time
and its ratio to no recomputation (median of the per-round ratios [spread]), the planned
temporaries (``stats()["planned_peak_bytes"]``) and their ratio, and the process's peak RSS
(VmHWM) after the timed steps.

    python bench/remat.py --side none|selective|full --model gpt
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from mixed_precision import SHAPES, make  # noqa: E402

POLICIES = {"none": False, "selective": "selective", "full": "full"}


def _peak_rss_bytes():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def raf_side(name, policy, steps, cache_dir):
    import raf_dist
    from raf_dist import distributed as dist

    dist.get_config().activation_checkpointing = POLICIES[policy]
    module, x, y = make(name)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)
    xn, yn = x.numpy(), y.numpy()
    ms = harness.median_ms(lambda: trainer.step(xn, yn), steps)
    return {"ms": ms, "planned_peak_bytes": trainer.stats()["planned_peak_bytes"],
            "peak_rss_bytes": _peak_rss_bytes()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=[*SHAPES, "all"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=None)
    parser.add_argument("--side", choices=list(POLICIES), help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return harness.report(raf_side(args.model, args.side, args.steps, args.cache_dir))

    names = list(SHAPES) if args.model == "all" else [args.model]
    cpu_set = harness.cores(args.cores)
    print(f"# raf_dist, float32, AdamW; {harness.machine()}; each side alone, {args.rounds} "
          f"alternating rounds of {args.steps} steps")
    print(f"{'model':9s} {'policy':10s} {'ms':>8s} {'time x none [spread]':>21s} "
          f"{'temps MB':>9s} {'temps x none':>12s} {'peak RSS MB':>11s}")
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in names:
            common = [sys.executable, __file__, "--model", name, "--steps", str(args.steps),
                      "--cache-dir", cache_dir]
            res = harness.alternate({p: common + ["--side", p] for p in POLICIES}, args.rounds,
                                    cpu_set)
            ms = {p: [r["ms"] for r in v] for p, v in res.items()}
            base = res["none"][0]["planned_peak_bytes"]
            for p in POLICIES:
                temps = res[p][0]["planned_peak_bytes"]
                rss = max(r["peak_rss_bytes"] for r in res[p])
                print(f"{name:9s} {p:10s} {statistics.median(ms[p]):8.1f} "
                      f"{harness.format_ratio(ms[p], ms['none']):>21s} {temps / 2**20:9.1f} "
                      f"{temps / base:12.2f} {rss / 2**20:11.1f}")


if __name__ == "__main__":
    main()
