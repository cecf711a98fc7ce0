"""Soak: a long 2-rank data-parallel run with ZeRO-2 and periodic checkpoints, under
RAF_DIST_CHECK_COLLECTIVES=1; resident memory per rank must stay flat after warm-up.

    python bench/soak.py [--np 2] [--steps 2000] [--every 100] [--batch 64] [--timeout 2400]

The driver starts one ``mpiexec -n NP`` job of this script (``--side``) in a process session of
its own (harness.run_side: killed as a group past ``--timeout``) with
RAF_DIST_CHECK_COLLECTIVES=1, and prints the series it reports: every ``--every`` steps each
rank saves a checkpoint (``save_checkpoint(dir, keep=2)``) and then records its current
resident set (VmRSS from /proc/self/status; getrusage's ru_maxrss is the peak, which cannot
show memory coming back), open file descriptors, threads and Python objects; rank 0 gathers
them. Verdict: RSS growth per rank from the first checkpoint after warm-up (step 2 * every)
to the last, "flat" when it is under 2 % or under 5 MB.

After the loop every rank builds a fresh Trainer (other initial values), loads the newest
checkpoint and compares its parameters and optimizer state bitwise with what the trained
Trainer held when it saved that checkpoint (a 2-rank load at the same level: resume must be
bitwise exact).

Model: MLP 20-64-64-5 (the tests' MLP, wider), AdamW, cross-entropy, global batch ``--batch``
split over the ranks by raf_dist.data.shard, data from a fixed numpy RNG (labels from a
random linear teacher, so the loss falls). Many cheap steps: the point is the step count.
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/models.py
import harness  # noqa: E402

SIZES = (20, 64, 64, 5)
ROWS = 4096


def _proc_status(field: str) -> int:
    """An integer field of /proc/self/status (VmRSS in kB, Threads)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _sample() -> dict:
    return {"rss_kb": _proc_status("VmRSS"), "threads": _proc_status("Threads"),
            "fds": len(os.listdir("/proc/self/fd")), "objects": len(gc.get_objects())}


def _make_module(seed):
    import torch

    from models import MLP  # tests/models.py

    torch.manual_seed(seed)
    return MLP(SIZES)


def _data():
    import numpy as np

    rng = np.random.default_rng(1234)
    x = rng.standard_normal((ROWS, SIZES[0]), dtype=np.float32)
    teacher = rng.standard_normal((SIZES[0], SIZES[-1])).astype(np.float32)
    y = (x @ teacher).argmax(axis=1).astype(np.int64)
    return x, y


def _trainer(seed, example, cache_dir):
    import torch

    import raf_dist
    from raf_dist import distributed as dist

    dist.get_config().update({"enable_data_parallel": True, "zero_opt_level": 2})
    model = raf_dist.frontend.from_pytorch(_make_module(seed), (torch.from_numpy(example),))
    return raf_dist.Trainer(model, loss="cross_entropy",
                            optimizer=raf_dist.optim.AdamW(lr=1e-3), cache_dir=cache_dir)


def _bitwise_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def side(args):
    import raf_dist
    from raf_dist import distributed as dist

    comm = dist.get_communicator()
    ckpt_dir = Path(args.dir) / "ckpt"
    cache_dir = str(Path(args.dir) / "cache")
    x, y = _data()
    local = args.batch // comm.size
    before = _sample()["rss_kb"]  # raf_dist, TVM, PyTorch and MPI imported
    trainer = _trainer(0, x[:local], cache_dir)
    built = _sample()["rss_kb"]  # + the compiled step

    series, saved, saves = [], None, 0
    step, epoch, interval_start = 0, 0, time.perf_counter()
    loss = float("nan")
    while step < args.steps:
        for xb, yb in raf_dist.data.shard((x, y), global_batch=args.batch, shuffle=True,
                                          epoch=epoch):
            loss = trainer.step(xb, yb)
            step += 1
            if step % args.every == 0:
                elapsed = time.perf_counter() - interval_start
                trainer.save_checkpoint(str(ckpt_dir), extra={"step": step}, keep=2)
                saves += 1
                if step + args.every > args.steps:  # the last save: keep what it wrote
                    saved = (trainer.state_dict(), trainer.optimizer_state_dict(),
                             trainer.step_count)
                sample = dict(_sample(), step=step, loss=loss,
                              ms_per_step=elapsed / args.every * 1e3)
                series.append(comm.mpi_comm.gather(sample, root=0))
                interval_start = time.perf_counter()
            if step >= args.steps:
                break
        epoch += 1

    # the newest checkpoint into a fresh Trainer (other initial values), compared bitwise
    kept = sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("step-"))
    fresh = _trainer(1, x[:local], cache_dir)
    differs_before = any(not _bitwise_equal(a, saved[0][n])
                         for n, a in fresh.state_dict().items())
    extra = fresh.load_checkpoint(str(ckpt_dir))
    params, states = fresh.state_dict(), fresh.optimizer_state_dict()
    param_mismatch = [n for n, a in saved[0].items() if not _bitwise_equal(params[n], a)]
    state_mismatch = [f"{p}.{s}" for p, d in saved[1].items() for s, a in d.items()
                      if not _bitwise_equal(states[p][s], a)]
    check = {"rank": comm.rank, "extra": extra, "step_count": fresh.step_count,
             "saved_step_count": saved[2], "fresh_init_differs": differs_before,
             "params": len(params), "param_mismatch": param_mismatch,
             "states": sum(len(d) for d in states.values()), "state_mismatch": state_mismatch}
    checks = comm.mpi_comm.gather(check, root=0)
    stats = trainer.stats()
    if comm.rank == 0:
        harness.report({
            "ranks": comm.size, "steps": step, "every": args.every, "batch": args.batch,
            "sizes": list(SIZES), "params": trainer.model.num_params(),
            "param_bytes": stats["param_bytes"],
            "optimizer_state_bytes": stats["optimizer_state_bytes"],
            "planned_peak_bytes": stats["planned_peak_bytes"],
            "check_collectives": os.environ.get("RAF_DIST_CHECK_COLLECTIVES"),
            "rss_before_trainer_kb": before, "rss_after_trainer_kb": built,
            "saves": saves, "kept": kept,
            "series": series, "load": checks})


def _verdict(series, base_index, rank):
    base = series[base_index][rank]["rss_kb"] / 1024
    end = series[-1][rank]["rss_kb"] / 1024
    growth = end - base
    pct = growth / base * 100
    flat = growth < 5 or pct < 2
    return base, end, growth, pct, flat


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds for the whole job")
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args)
        return
    if args.steps < 3 * args.every:
        raise SystemExit("--steps must cover at least three checkpoints (warm-up, the base at "
                         "step 2 * every, one after it)")

    with tempfile.TemporaryDirectory(prefix="raf_dist_soak_") as tmp:
        argv = [harness.mpiexec(), "-n", str(args.np), sys.executable, __file__, "--side",
                "--steps", str(args.steps), "--every", str(args.every), "--batch",
                str(args.batch), "--dir", tmp]
        began = time.perf_counter()
        r = harness.run_side(argv, timeout=args.timeout,
                             env={"RAF_DIST_CHECK_COLLECTIVES": "1"})
        wall = time.perf_counter() - began

    series, n = r["series"], r["ranks"]
    print(f"# {n} ranks, ZeRO-2, AdamW, MLP {'-'.join(map(str, r['sizes']))} "
          f"({r['params']:,} parameters), global batch {r['batch']}, {r['steps']} steps, "
          f"checkpoint (keep=2) + sample every {r['every']}; "
          f"RAF_DIST_CHECK_COLLECTIVES={r['check_collectives']}; {harness.machine()}; "
          f"job wall {wall:.0f} s")
    print(f"# per rank (Trainer.stats): params {r['param_bytes'] / 1024:.1f} KB, optimizer state "
          f"{r['optimizer_state_bytes'] / 1024:.1f} KB, planned temporaries "
          f"{r['planned_peak_bytes'] / 1024:.1f} KB; rank 0 RSS after the imports "
          f"{r['rss_before_trainer_kb'] / 1024:.1f} MB, with the Trainer built "
          f"{r['rss_after_trainer_kb'] / 1024:.1f} MB")
    print("# loss: the global mean loss of the batch at that step; ms/step: mean over the last "
          "interval, slower rank, checkpoint excluded; fds / thr / objs: open file descriptors, "
          "threads, Python objects tracked by gc, per rank")
    head = f"{'step':>5s}" + "".join(f" {'RSS MB r' + str(k):>10s}" for k in range(n))
    head += f" {'loss':>8s} {'ms/step':>8s}" + "".join(
        f" {'fds r' + str(k):>6s} {'thr r' + str(k):>6s} {'objs r' + str(k):>8s}" for k in range(n))
    print(head)
    for row in series:
        line = f"{row[0]['step']:5d}" + "".join(f" {s['rss_kb'] / 1024:10.1f}" for s in row)
        line += f" {row[0]['loss']:8.4f} {max(s['ms_per_step'] for s in row):8.1f}"
        line += "".join(f" {s['fds']:6d} {s['threads']:6d} {s['objects']:8d}" for s in row)
        print(line)
    base_index = 1  # the checkpoint at step 2 * every: the first one after warm-up
    base_step = series[base_index][0]["step"]
    verdicts = []
    for rank in range(n):
        base, end, growth, pct, flat = _verdict(series, base_index, rank)
        verdicts.append(flat)
        kb = series[-1][rank]["rss_kb"] - series[base_index][rank]["rss_kb"]
        steps = series[-1][0]["step"] - base_step
        print(f"# rank {rank}: RSS {base:.1f} MB at step {base_step} -> {end:.1f} MB at step "
              f"{series[-1][0]['step']}: {growth:+.2f} MB ({kb:+d} kB, {pct:+.3f} %, "
              f"{kb * 1024 / steps:+.0f} bytes/step) {'flat' if flat else 'GROWING'}; "
              f"min/max RSS over the samples "
              f"{min(row[rank]['rss_kb'] for row in series)}/"
              f"{max(row[rank]['rss_kb'] for row in series)} kB")
    print(f"# verdict: {'flat' if all(verdicts) else 'NOT flat'} (growth < 2 % or < 5 MB per rank "
          f"from step {base_step}); median ms/step "
          f"{statistics.median(max(s['ms_per_step'] for s in row) for row in series):.1f}")
    loads = r["load"]
    ok = all(not c["param_mismatch"] and not c["state_mismatch"]
             and c["step_count"] == c["saved_step_count"] for c in loads)
    c0 = loads[0]
    print(f"# checkpoints written: {r['saves']}, kept on disk: {', '.join(r['kept'])}; last one "
          f"loaded into a fresh {n}-rank Trainer (initial values differed: "
          f"{all(c['fresh_init_differs'] for c in loads)}): {c0['params']} parameters and "
          f"{c0['states']} optimizer states per rank "
          f"{'bitwise equal' if ok else 'DIFFER'} to the trainer's at save time, step_count "
          f"{c0['step_count']}, extra {c0['extra']}")
    if not ok:
        for c in loads:
            print(f"#   rank {c['rank']}: params differ {c['param_mismatch']}, states differ "
                  f"{c['state_mismatch']}, step_count {c['step_count']} vs {c['saved_step_count']}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
