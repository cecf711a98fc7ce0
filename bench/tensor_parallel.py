"""Tensor parallelism: what each rank holds and sends, for T = 1, 2, 4 (the GPT of
bench/step_time.py: 4 layers, d=128, 4 heads, seq 64, vocab 512, batch 16; AdamW).

    python bench/tensor_parallel.py [--tp 1,2,4] [--steps 10]

One job per T (``mpiexec -n T``, tensor_parallel_size=T, no data parallelism: every rank
passes the whole batch). Printed per T: parameter and optimizer-state bytes per rank (the
split layers must fall ~T-fold, the replicated ones not), the step's planned temporaries, the
bus bytes per step on the tp group against the plan's count, and the step time (slowest
rank, median). T ranks on a 2-core machine oversubscribe it from T = 4 on and small matmuls
gain little from splitting: the bytes are the result, the time is context.

    python bench/tensor_parallel.py --side --tp 2     one job's rank 0 prints a BENCH line
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import step_time  # noqa: E402


def side(tp, steps, cache_dir):
    import raf_dist
    from raf_dist import distributed as dist

    comm = dist.get_communicator()
    dist.get_config().tensor_parallel_size = tp
    module, x, y = step_time.make("gpt")
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)
    xn, yn = x.numpy(), y.numpy()

    def timer(fn):
        from mpi4py import MPI

        comm.mpi_comm.Barrier()
        start = time.perf_counter()
        fn()
        return comm.mpi_comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    ms = harness.median_ms(lambda: trainer.step(xn, yn), steps, timer=timer)
    stats = trainer.stats()
    full = {n: p.nbytes for n, p in model_params(module).items()}
    plan = trainer.tp_plan
    split = sum(full[n] for n in plan.placements) if plan else 0
    if plan:
        planned = (sum(plan.forward_reduces) + sum(plan.backward_reduces)
                   + sum(plan.loss_reduces) + 1) * 4 * 2 * (tp - 1) / tp  # +1: non-finite verdict
    else:
        planned = 0.0
    if comm.rank == 0:
        harness.report({
            "tp": tp, "ms": ms, "param_bytes": stats["param_bytes"],
            "optimizer_state_bytes": stats["optimizer_state_bytes"],
            "planned_peak_bytes": stats["planned_peak_bytes"],
            "full_param_bytes": sum(full.values()), "split_param_bytes": split,
            "tp_bus_bytes": stats["comm_bytes_last_step"].get("allreduce", 0.0),
            "planned_tp_bus_bytes": planned,
            "split": sorted(plan.placements) if plan else []})


def model_params(module):
    return {n: p.detach().numpy() for n, p in module.named_parameters()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--side", action="store_true")
    parser.add_argument("--cache-dir")
    args = parser.parse_args()
    if args.side:
        side(int(args.tp), args.steps, args.cache_dir)
        return
    sizes = [int(t) for t in args.tp.split(",")]
    print(f"# {harness.machine()}")
    print("# GPT of bench/step_time.py (4 layers, d=128, 4 heads, seq 64, vocab 512, batch 16), "
          f"AdamW, median of {args.steps} steps (slowest rank)")
    results = {}
    with tempfile.TemporaryDirectory() as cache:
        for tp in sizes:
            argv = [harness.mpiexec(), "-n", str(tp), sys.executable, __file__, "--side",
                    "--tp", str(tp), "--steps", str(args.steps), "--cache-dir", cache]
            results[tp] = harness.run_side(argv)
    base = results[sizes[0]]
    mb = 2**20
    print(f"{'T':>2} {'params/rank MB':>15} {'vs T=1':>7} {'split layers/rank MB':>21} "
          f"{'opt state MB':>13} {'planned temps MB':>17} {'tp bus KB/step':>15} "
          f"{'plan KB':>8} {'step ms':>8}")
    for tp, r in results.items():
        split_held = r["split_param_bytes"] / tp
        print(f"{tp:>2} {r['param_bytes'] / mb:15.2f} {r['param_bytes'] / base['param_bytes']:7.2f} "
              f"{split_held / mb:21.2f} {r['optimizer_state_bytes'] / mb:13.2f} "
              f"{r['planned_peak_bytes'] / mb:17.2f} {r['tp_bus_bytes'] / 1024:15.1f} "
              f"{r['planned_tp_bus_bytes'] / 1024:8.1f} {r['ms']:8.1f}")
    last = results[sizes[-1]]
    print(f"# split at T={sizes[-1]}: {len(last['split'])} of the parameters "
          f"({last['split_param_bytes'] / last['full_param_bytes']:.0%} of the bytes); "
          "the rest (layer norms, row-parallel biases, position table) is replicated")


if __name__ == "__main__":
    main()
