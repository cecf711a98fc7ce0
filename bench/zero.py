"""ZeRO levels 0-3: step time, memory per rank and traffic per step, the DP row (level 0) as
the reference measured in the same run.

    python bench/zero.py [--np 2] [--model mlp|gpt|all] [--steps 10] [--rounds 3] [--bucket-mb 25]

Models are bench/step_time.py's (MLP batch 128, GPT batch 16), AdamW, global batch split over
the ranks. All four levels are built first, then timed round-robin (one step of each level in
turn, barrier before each, slowest rank), so machine noise hits every level alike; medians over
``--steps`` rounds; the whole job (its own `mpiexec -n N`) runs ``--rounds`` times and "x DP"
is the median of the per-job ratios with their spread. Memory is what Trainer.stats() reports: parameters and optimizer state held
between steps and the step's planned temporaries; "peak" is their sum. Traffic is the bus
bytes this rank sent in one step. Goals (issue #14): level 2 <= 1.1x DP, level 3 <= 1.3x DP.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import step_time  # noqa: E402

LEVELS = (0, 1, 2, 3)


def _mb(nbytes):
    return nbytes / 2**20


def run(name, steps, bucket_mb, cache_dir, comm):
    from mpi4py import MPI

    import raf_dist
    from raf_dist import distributed as dist

    n, rank = comm.size, comm.rank
    trainers = {}
    for level in LEVELS:
        module, x, y = step_time.make(name)  # same initial parameters for every level
        local = x.shape[0] // n
        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": level,
                                  "bucket_size_mb": bucket_mb})
        trainers[level] = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (xs,)),
                                           optimizer=raf_dist.optim.AdamW(lr=1e-3),
                                           cache_dir=cache_dir)
    xn, yn = xs.numpy(), ys.numpy()
    for _ in range(2):
        for trainer in trainers.values():
            trainer.step(xn, yn)
    times = {level: [] for level in LEVELS}
    losses = {}
    for _ in range(steps):
        for level, trainer in trainers.items():
            comm.mpi_comm.Barrier()
            start = time.perf_counter()
            losses[level] = trainer.step(xn, yn)
            elapsed = time.perf_counter() - start
            times[level].append(comm.mpi_comm.allreduce(elapsed, op=MPI.MAX))
    rows = []
    for level, trainer in trainers.items():
        stats = trainer.stats()
        traffic = stats["comm_bytes_last_step"]
        rows.append({
            "level": level, "ms": statistics.median(times[level]) * 1e3,
            "params": stats["param_bytes"], "optim": stats["optimizer_state_bytes"],
            "temps": stats["planned_peak_bytes"],
            "peak": stats["param_bytes"] + stats["optimizer_state_bytes"] + stats["planned_peak_bytes"],
            "allreduce": traffic.get("allreduce", 0.0),
            "reduce_scatter": traffic.get("reduce_scatter", 0.0),
            "allgather": traffic.get("allgather", 0.0), "loss": losses[level],
            "psi": trainer.model.num_params()})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--model", default="all", choices=["mlp", "gpt", "all"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--side", choices=["worker"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = ["mlp", "gpt"] if args.model == "all" else [args.model]
    if args.side:
        from raf_dist import distributed as dist
        comm = dist.get_communicator()
        results = {name: run(name, args.steps, args.bucket_mb, args.cache_dir, comm)
                   for name in names}
        if comm.rank == 0:
            harness.report(results)
        return

    with tempfile.TemporaryDirectory() as cache_dir:
        argv = [harness.mpiexec(), "-n", str(args.np), sys.executable, __file__, "--side", "worker",
                "--model", args.model, "--steps", str(args.steps), "--bucket-mb",
                str(args.bucket_mb), "--cache-dir", cache_dir]
        rounds = harness.alternate({"job": argv}, args.rounds)["job"]
    n = args.np
    print(f"# {n} ranks, AdamW, buckets of {args.bucket_mb} MB; {harness.machine()}; median of "
          f"{args.steps} round-robin steps (slowest rank) per job, {args.rounds} jobs; memory and "
          "traffic per rank (MB), from the last job; x DP: median [spread] over the jobs")
    for name in names:
        rows = rounds[-1][name]
        base = rows[0]
        psi = base["psi"]
        print(f"\n{name}: {psi:,} parameters; 2Ψ(N-1)/N·4 = {_mb(2 * psi * (n - 1) / n * 4):.2f} MB")
        print(f"{'level':>5s} {'step ms':>8s} {'x DP [spread]':>17s} {'params':>7s} {'optim':>7s} "
              f"{'temps':>7s} {'peak':>7s} {'x DP':>5s} {'allreduce':>9s} {'red_scat':>8s} "
              f"{'allgather':>9s} {'loss':>9s}")
        for index, r in enumerate(rows):
            times = [job[name][index]["ms"] for job in rounds]
            dp_times = [job[name][0]["ms"] for job in rounds]
            print(f"{r['level']:5d} {statistics.median(times):8.2f} "
                  f"{harness.format_ratio(times, dp_times):>17s} "
                  f"{_mb(r['params']):7.2f} {_mb(r['optim']):7.2f} {_mb(r['temps']):7.2f} "
                  f"{_mb(r['peak']):7.2f} {r['peak'] / base['peak']:5.2f} "
                  f"{_mb(r['allreduce']):9.2f} {_mb(r['reduce_scatter']):8.2f} "
                  f"{_mb(r['allgather']):9.2f} {r['loss']:9.5f}")


if __name__ == "__main__":
    main()
