"""Activation recomputation: planned step temporaries, step time and peak RSS of raf_dist's
step without recomputation, with ``activation_checkpointing="selective"`` and with ``"full"``,
each side alone (DESIGN.md section 6; the peer is raf_dist without recomputation, as the
targets of issue #31 are ratios against it).

    python bench/remat.py [--model gpt|gemm_gpt|all] [--steps 8] [--rounds 3] [--cores K]

Models (AdamW, float32): bench/mixed_precision.py's ``gpt`` (bench/step_time.py's GPT: 4
layers, d=128, seq 64, vocab 512, batch 16) and ``gemm_gpt`` (6 layers, d=512, 8 heads, seq
128, vocab 4096, batch 8; 23M parameters). Printed per model and policy: the median step time
and its ratio to no recomputation (median of the per-round ratios [spread]), the same for
the process's CPU time per step and the hypervisor's steal meanwhile (a shared VM's wall
time moves by tens of percent between runs: the CPU time says whether the work did), the planned
temporaries (``stats()["planned_peak_bytes"]``) and their ratio, and the process's peak RSS
(VmHWM) after the timed steps.

    python bench/remat.py --budget-mb 600 [--model gemm_gpt] [--policies selective,full]

instead finds, for each policy, the largest batch (even) whose planned temporaries fit the
budget (TVM's memory planner on the step, nothing run), then trains each policy at its batch
alone and prints the batch against no recomputation's and the samples/s against its
(issue #31's target: >= 2x the batch at >= 90% of the samples/s); the side ``budget`` trains
twice none's batch with ``activation_memory_budget_mb`` set, the compiler choosing its
recomputation (the least that fits: runtime/spmd_executor.py).

    python bench/remat.py --side none|selective|full --model gpt [--batch B]
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


def make_at(name, batch=None):
    """(module, x, y) of bench/mixed_precision.py's model ``name`` with ``batch`` rows
    (default: its own batch)."""
    module, x, y = make(name)
    if batch is None or batch == len(x):
        return module, x, y
    import torch

    gen = torch.Generator().manual_seed(2)
    kwargs = SHAPES[name][0]  # None for the transformers 124M models: their config says
    vocab = kwargs["vocab"] if kwargs else module.model.config.vocab_size
    return (module, torch.randint(0, vocab, (batch,) + tuple(x.shape[1:]), generator=gen),
            torch.randint(0, vocab, (batch,) + tuple(y.shape[1:]), generator=gen))


def planned_temporaries(name, policy, batch):
    """The planned step temporaries of ``name`` at ``batch`` rows under ``policy`` (TVM's
    memory planner on the step the Trainer would build on one process; nothing compiled)."""
    import raf_dist
    from raf_dist.compiler import plan_memory
    from raf_dist.compiler.step_passes import nonfinite_guard, step_passes
    from raf_dist.training import build_train_step

    module, x, _ = make_at(name, batch)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    mod, _ = build_train_step(model, "cross_entropy", raf_dist.optim.AdamW(lr=1e-3),
                              nonfinite_guard=nonfinite_guard(0, 1),
                              recompute=POLICIES[policy] or None)
    return plan_memory(mod, step_passes(0, 1, 25 * 2**20))


def largest_batch(name, policy, budget_bytes, start):
    """The largest batch (a multiple of 2 from ``start``) whose planned temporaries fit."""
    fits = {}

    def fit(batch):
        if batch not in fits:
            fits[batch] = planned_temporaries(name, policy, batch) <= budget_bytes
        return fits[batch]

    low, high = 0, start
    while fit(high):  # double until one does not fit
        low, high = high, high * 2
    while high - low > 2:  # then halve the gap (even batches)
        mid = (low + high) // 2 // 2 * 2
        low, high = (mid, high) if fit(mid) else (low, mid)
    return low


def raf_side(name, policy, steps, cache_dir, batch=None, budget_mb=None):
    import raf_dist
    from raf_dist import distributed as dist

    if policy == "budget":  # the compiler's choice of points within the budget
        dist.get_config().activation_memory_budget_mb = budget_mb
    else:
        dist.get_config().activation_checkpointing = POLICIES[policy]
    module, x, y = make_at(name, batch)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)
    xn, yn = x.numpy(), y.numpy()
    timed = harness.median_wall_cpu_ms(lambda: trainer.step(xn, yn), steps)
    return {**timed, "planned_peak_bytes": trainer.stats()["planned_peak_bytes"],
            "peak_rss_bytes": _peak_rss_bytes(), "rows": len(xn),
            "recompute": str(trainer.executor.recompute)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=[*SHAPES, "all"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=None)
    parser.add_argument("--budget-mb", type=float, default=None,
                        help="instead: the largest batch each policy fits in this many MB of "
                             "planned temporaries, and its samples/s")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="with --budget-mb: the fixed policies searched and trained besides "
                             "none (comma-separated; default all; the budget side always runs)")
    parser.add_argument("--side", choices=[*POLICIES, "budget"], help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return harness.report(raf_side(args.model, args.side, args.steps, args.cache_dir,
                                       args.batch, args.budget_mb))
    if args.budget_mb is not None:
        return batch_at_budget(args)

    names = list(SHAPES) if args.model == "all" else [args.model]
    cpu_set = harness.cores(args.cores)
    print(f"# raf_dist, float32, AdamW; {harness.machine()}; each side alone, {args.rounds} "
          f"alternating rounds of {args.steps} steps")
    print(f"{'model':9s} {'policy':10s} {'ms':>8s} {'time x none [spread]':>21s} "
          f"{'CPU time x none [spread]':>25s} {'steal':>6s} "
          f"{'temps MB':>9s} {'temps x none':>12s} {'peak RSS MB':>11s}")
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in names:
            common = [sys.executable, __file__, "--model", name, "--steps", str(args.steps),
                      "--cache-dir", cache_dir]
            res = harness.alternate({p: common + ["--side", p] for p in POLICIES}, args.rounds,
                                    cpu_set)
            ms = {p: [r["ms"] for r in v] for p, v in res.items()}
            cpu = {p: [r["cpu_ms"] for r in v] for p, v in res.items()}
            base = res["none"][0]["planned_peak_bytes"]
            for p in POLICIES:
                temps = res[p][0]["planned_peak_bytes"]
                rss = max(r["peak_rss_bytes"] for r in res[p])
                steal = statistics.median(r["steal"] for r in res[p])
                print(f"{name:9s} {p:10s} {statistics.median(ms[p]):8.1f} "
                      f"{harness.format_ratio(ms[p], ms['none']):>21s} "
                      f"{harness.format_ratio(cpu[p], cpu['none']):>25s} {100 * steal:5.1f}% "
                      f"{temps / 2**20:9.1f} {temps / base:12.2f} {rss / 2**20:11.1f}")


def batch_at_budget(args):
    """For each model and policy: the largest batch whose planned temporaries fit
    ``--budget-mb`` (planned, not run), then that batch trained alone for samples/s."""
    names = list(SHAPES) if args.model == "all" else [args.model]
    cpu_set = harness.cores(args.cores)
    budget = args.budget_mb * 2**20
    print(f"# raf_dist, float32, AdamW; {harness.machine()}; planned temporaries <= "
          f"{args.budget_mb:g} MB; each side alone, {args.rounds} alternating rounds of "
          f"{args.steps} steps")
    print(f"{'model':9s} {'policy':10s} {'batch':>6s} {'x none':>7s} {'samples/s':>10s} "
          f"{'samples/s x none [spread]':>26s}")
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in names:
            # none's batch is the reference: it is always searched
            policies = ["none"] + [p for p in POLICIES if p != "none"
                                   and p in args.policies.split(",")]
            batches = {p: largest_batch(name, p, budget, SHAPES[name][1]) for p in policies}
            common = [sys.executable, __file__, "--model", name, "--steps", str(args.steps),
                      "--cache-dir", cache_dir]
            sides = {p: common + ["--side", p, "--batch", str(batches[p])]
                     for p in policies if batches[p]}
            if batches["none"]:  # the target's batch, twice none's, at the compiler's choice
                batches["budget"] = 2 * batches["none"]
                sides["budget"] = common + ["--side", "budget", "--batch",
                                            str(batches["budget"]), "--budget-mb",
                                            str(args.budget_mb)]
            res = harness.alternate(sides, args.rounds, cpu_set)
            rate = {p: [r["rows"] / r["ms"] * 1e3 for r in v] for p, v in res.items()}
            for p in [*policies, "budget"]:
                if p == "budget" and p not in batches:
                    continue
                if not batches[p]:
                    print(f"{name:9s} {p:10s} {'-':>6s}  (no batch fits)")
                    continue
                ratio = (harness.format_ratio(rate[p], rate["none"]) if "none" in rate
                         else "-")
                print(f"{name:9s} {p:10s} {batches[p]:6d} "
                      f"{batches[p] / max(batches['none'], 1):7.2f} "
                      f"{statistics.median(rate[p]):10.1f} {ratio:>26s}"
                      + (f"  chose {res[p][0]['recompute']}" if p == "budget" else ""))


if __name__ == "__main__":
    main()
