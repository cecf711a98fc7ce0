"""Cost of the non-finite check in a data-parallel (level 0) step: the same step built with
and without it, in one process, timed alternately (both sides are raf_dist: same process,
same settings, so no peer is handicapped), then the top calls of each from the profiler.

    python bench/nonfinite_check.py [--model mlp|gpt] [--steps 30]

The 2-rank data-parallel IR runs in a world of one (its allreduce returns at once) on half
of bench/step_time.py's batch, i.e. what one of two ranks computes.
"""
import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    import raf_dist
    import raf_dist.runtime.spmd_build as trainer_module  # what builds the Trainer's step
    from raf_dist.compiler.step_passes import step_passes

    module, x, y = step_time.make(args.model)
    half = x.shape[0] // 2
    xs, ys = x[:half].numpy(), y[:half].numpy()
    model = raf_dist.frontend.from_pytorch(module, (x[:half],))
    checked = trainer_module.nonfinite_guard
    trainer_module.SPMDBuilder.passes = lambda self, local=False: step_passes(
        0, 2, 25 * 2**20, overlap=True, group=self.comm.group)
    trainers = {}
    for name, guard in (("checked", checked), ("unchecked", lambda *a, **k: None)):
        trainer_module.nonfinite_guard = guard
        trainers[name] = raf_dist.Trainer(model, optimizer=raf_dist.optim.AdamW(lr=1e-3))
    trainer_module.nonfinite_guard = checked
    times = {name: [] for name in trainers}
    for _ in range(args.steps + 5):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(xs, ys)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{args.model} {name:9s} {statistics.median(values[5:]) * 1e3:7.2f} ms")
    with tempfile.TemporaryDirectory() as directory:
        for name, trainer in trainers.items():
            path = trainer.profile(5, Path(directory) / name)
            for _ in range(5):
                trainer.step(xs, ys)
            events = json.loads(Path(path).read_text())
            events = events["traceEvents"] if isinstance(events, dict) else events
            totals = collections.Counter()
            for event in events:
                if event.get("ph") == "X" and event.get("cat") != "step":
                    totals[event["name"]] += event.get("dur", 0) / 5
            top = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in totals.most_common(6))
            print(f"  {name} top calls (ms per step): {top}")


if __name__ == "__main__":
    main()
