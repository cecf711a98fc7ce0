"""A step's matmuls by shape: their time inside the step against what the cost model says
(raf_dist.proxies' ``Cluster.gemm_efficiency``), at the whole batch and at a pipeline's
microbatch.

    .venv/bin/python bench/matmul_shapes.py [--batches 16,4] [--steps 10]

Model: bench/step_time.py's GPT (as bench/plan_validation.py). For each batch size one process
on one core (as every rank of plan_validation's jobs computes) trains it and records
``--steps`` steps with ``Trainer.profile`` (every ``raf_dist.blas.matmul`` call, its operand
shapes); the driver measures, also on that core, each shape run warm in a loop
(``raf_dist.proxies.calibrate.gemm_efficiency``) and prints per shape the median time of a
call inside the step, the cost model's (its FLOPs at the shape's measured rate plus its
operands' and result's bytes at the copy bandwidth), and what one matmul rate (the 1024^3
GEMM's, the model before 2026-11-30) gives; then each batch's totals. The profiler's own cost
is outside the calls it times (a Python callback between them).
"""
import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def side(batch, steps, out_dir):
    """Profile ``steps`` steps of the GPT at ``batch`` rows on this process."""
    import raf_dist
    from step_time import make

    module, x, y = make("gpt")
    x, y = x[:batch], y[:batch]
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3))
    xs, ys = x.numpy(), y.numpy()
    for _ in range(15):  # warm: first-touch allocations, the BLAS's buffers
        trainer.step(xs, ys)
    path = trainer.profile(steps, out_dir)
    for _ in range(steps):
        trainer.step(xs, ys)
    harness.report({"trace": path})


def calls_by_shape(trace_path):
    """{gemm_key: [seconds of each call]} of a profiled step's raf_dist.blas.matmul calls (the
    trace names their operand shapes and transpose flags)."""
    from raf_dist.proxies.workload import gemm_key

    events = json.loads(Path(trace_path).read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    calls = defaultdict(list)
    for e in events:
        if e.get("cat") == "blas" and e["name"].endswith("matmul"):
            a, b, _ = e["args"]["shapes"]
            trans_a, trans_b = e["args"]["trans"]
            calls[gemm_key(a, b, trans_a, trans_b)].append(e["dur"] * 1e-6)
    return calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--side", action="store_true")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", default="16,4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", help="--side: where the trace goes")
    a = p.parse_args()
    if a.side:
        side(a.batch, a.steps, a.out)
        return
    import dataclasses

    from plan_validation import calibrated
    from raf_dist.proxies import Event
    from raf_dist.proxies.simulate import compute_seconds
    from raf_dist.proxies.workload import gemm_flops

    tmp = tempfile.mkdtemp(prefix="raf_dist_mm_")
    one_core = harness.cores(1)
    traces = {}
    for batch in (int(v) for v in a.batches.split(",")):
        traces[batch] = harness.run_side(
            [sys.executable, __file__, "--side", "--batch", str(batch), "--steps", str(a.steps),
             "--out", str(Path(tmp) / f"b{batch}")], cpu_set=one_core, timeout=900)["trace"]
    calls = {batch: calls_by_shape(path) for batch, path in traces.items()}
    # the cost model's inputs on that core: calibrate (one process) with these shapes
    cluster = calibrated(1, tmp, one_core, gemm_keys={k for c in calls.values() for k in c})
    one_rate = dataclasses.replace(cluster, gemm_efficiency={})
    print(f"# {harness.machine()}; one process on one core; 1024^3 GEMM "
          f"{cluster.matmul_tflops * 1e3:.1f} GFLOP/s, copy {cluster.memory_GBps:.1f} GB/s")
    for batch, mine in calls.items():
        print(f"batch {batch}: shape (a, b, transposes)        calls/step  in step us  "
              "model us  (warm rate)  one rate us")
        totals = [0.0, 0.0, 0.0]
        for key, times in sorted(mine.items(), key=lambda kv: -sum(kv[1])):
            # one call as the simulator charges it, with and without the shapes' rates
            call = Event("compute", flops=gemm_flops(key), gemms={key: 1})
            model, flat = compute_seconds(call, cluster), compute_seconds(call, one_rate)
            efficiency = cluster.gemm_efficiency[key]
            totals[0] += sum(times) / a.steps
            totals[1] += len(times) / a.steps * model
            totals[2] += len(times) / a.steps * flat
            print(f"  {key:38s} {len(times) / a.steps:>6.0f} "
                  f"{statistics.median(times) * 1e6:>11.1f} {model * 1e6:>9.1f} "
                  f"{efficiency:>11.2f} {flat * 1e6:>12.1f}")
        print(f"  a step's matmuls: {totals[0] * 1e3:.1f} ms in the step, model "
              f"{totals[1] * 1e3:.1f} ms ({totals[1] / totals[0] - 1:+.1%}), one rate "
              f"{totals[2] * 1e3:.1f} ms ({totals[2] / totals[0] - 1:+.1%})")


if __name__ == "__main__":
    main()
