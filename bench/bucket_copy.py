"""What writing gradients in place into their buckets saves: the data-parallel step (2-rank
IR, 25 MB buckets, AdamW) built twice in one process — with WriteGradientsIntoBuckets (every
gradient computed in its bucket) and without it (gradients packed into the bucket by a copy,
the form AllReduceGradients emits) — timed alternately on the same data.

    python bench/bucket_copy.py [--model mlp|gpt|all] [--steps 20]

One process: the allreduce over a world of one returns at once, so the difference is the
copies (and their memory traffic) alone. Prints medians, their ratio, and planned memory.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time  # noqa: E402

import raf_dist  # noqa: E402
from raf_dist.compiler import inplace_buckets  # noqa: E402
from raf_dist.compiler.step_passes import step_passes  # noqa: E402


def build(module, x, in_place, cache_dir):
    def passes(self, config):  # the 2-rank data-parallel step; a world of one runs it
        return step_passes(0, 2, 25 * 2**20, overlap=True, group=self.comm.group)

    patches = [mock.patch.object(raf_dist.Trainer, "_passes", passes)]
    if not in_place:
        patches.append(mock.patch.object(inplace_buckets, "_rewrite", lambda func: func))
    for p in patches:
        p.start()
    try:
        return raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)
    finally:
        for p in patches:
            p.stop()


def run(name, steps):
    module, x, y = step_time.make(name)
    x, y = x[:x.shape[0] // 2], y[:y.shape[0] // 2]  # one rank's half of the global batch
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        trainers = {"in place": build(module, x, True, a), "copied": build(module, x, False, b)}
    xn, yn = x.numpy(), y.numpy()
    times = {k: [] for k in trainers}
    for _ in range(3):
        for t in trainers.values():
            t.step(xn, yn)
    for _ in range(steps):
        for k, t in trainers.items():
            start = time.perf_counter()
            t.step(xn, yn)
            times[k].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mem = {k: t.stats()["planned_peak_bytes"] / 2**20 for k, t in trainers.items()}
    print(f"{name:5s} {med['in place']:12.2f} {med['copied']:10.2f} "
          f"{med['in place'] / med['copied']:6.2f} {mem['in place']:12.2f} {mem['copied']:10.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all", choices=["mlp", "gpt", "all"])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print("# one process, 2-rank data-parallel IR, 25 MB buckets, AdamW; median of "
          f"{args.steps} alternating steps")
    print("model in-place ms  copied ms  ratio  in-place MB  copied MB")
    for name in (["mlp", "gpt"] if args.model == "all" else [args.model]):
        run(name, args.steps)


if __name__ == "__main__":
    main()
