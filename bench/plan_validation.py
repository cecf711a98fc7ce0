"""The planner's predictions against measured steps on this machine (issue #33's proof).

    .venv/bin/python bench/plan_validation.py [--ranks 2,4,8] [--repeats 2] [--rounds 3]
        [--steps 10] [--block-warmup 2] [--warmup 15] [--no-bind] [--png out.png]
        [--predict-only ROWS.json]

Model: bench/step_time.py's GPT (4 layers, d 128, 4 heads, seq 64, vocab 512), global batch
16, AdamW. Every mesh of 2, 4 and 8 ranks (dp, tp, pp and their products; ZeRO 0-3 on the
pure dp meshes; 2 x pp microbatches under pipelining) is measured and predicted.

Measured in one job per rank count (``--repeats`` such jobs, the rank counts in turn), each
rank bound to one core (``harness.BIND``; ``--no-bind`` leaves them to the scheduler). The
job builds a Trainer of every mesh of its ranks, and on rank 0 a Trainer of the model alone
(``local=True``: one process, one core, one thread, as every rank of these jobs computes),
steps each ``--warmup`` times (with more ranks than cores a job's first ~15 steps run 10-30%
slower: bench/RESULTS.md "Steady steps"), then runs ``--rounds`` rounds of:
  1. rank 0 alone, the other ranks asleep: this host's compute measured on its one core
     (``raf_dist.proxies.calibrate.measure`` over ``MPI.COMM_SELF``: GEMM and copy rates, host
     time per operator call) and the one-process step (the reference);
  2. every rank: the host measured with all of them sharing its cores (``measure`` over the
     world: each rank's GEMM rate while the others run theirs, the memory rate as rank 0's
     alone times that share of its core, raf_dist's allreduce alpha and bandwidth, a
     meeting's lateness per group shape, ``Cluster.meeting_groups``);
  3. each mesh's Trainer in turn (the order rotated by a place each round): ``--block-warmup``
     steps, then ``--steps`` steps, rank 0's clock (every step ends in the loss allreduce),
     their median.
A round lasts a minute or two. Between separate jobs minutes apart this shared host's speed
moved a mesh's median by up to 20% and one calibration's figures 2-3x (stop 61: the same
model scored 25 and 19 of 26 on two sets of rows); within a round the reference, the
calibration and the meshes share the host's speed of that minute.

Predicted per round, from that round's figures only: raf_dist.proxies' extraction of the
mesh's step simulated on the round's N-rank cluster, with every matmul shape's rate relative
to the 1024^3 one (``Cluster.gemm_efficiency``, measured once alone on one core:
``calibrate --gemm-shapes``), and the compute rates scaled so that the one-process step
simulated on the round's one-core figures equals the round's reference (the issue's "this
machine's measured kernel times scaled"); the host time per operator call is the
calibration's, not scaled. Nothing is fitted per mesh. A row is the median over its rounds
(all jobs) of the measured and of the predicted step; its error is theirs, shown beside the
range of the rounds' own errors and measured steps. The planner's first choice (ranked as
raf_dist.tools.plan ranks: every mesh under one cluster description, here the median of the
rounds' figures; at equal time the smaller footprint) is checked against the two fastest
measured rows.

The rows file (``--rows-out``, written after every job) holds every round's figures and
measurements, so ``--predict-only FILE`` predicts them again offline in seconds (a new model
on the same measurements); it measures the matmul shapes again only if the extractions run a
shape the file has no rate for. bench/plan_validation_rows/ keeps the runs of bench/RESULTS.md
("The validation in interleaved jobs"). Prints the table (with what one matmul rate for every shape
would predict), the share within 20%, the first choices, and draws the scatter (the rounds'
measured range as error bars).
"""
import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

GLOBAL_BATCH = 16


def meshes(n):
    """(dp, tp, pp, zero, microbatches) of every mesh of ``n`` ranks (module docstring)."""
    out = []
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            if GLOBAL_BATCH % dp:
                continue
            m = 2 * pp if pp > 1 else 1
            if (GLOBAL_BATCH // dp) % m:
                continue
            zeros = (0, 1, 2, 3) if dp > 1 and tp == pp == 1 else (0,)
            out += [(dp, tp, pp, z, m) for z in zeros]
    return out


def mesh_key(mesh) -> str:
    """A mesh's key in a job's report (JSON keys are strings)."""
    return ",".join(str(v) for v in mesh)


def _timed(trainer, xs, ys, steps, warmup=0):
    """``harness.median_ms`` of ``steps`` steps after ``warmup`` (this rank's clock) and the
    last loss."""
    losses = []
    ms = harness.median_ms(lambda: losses.append(trainer.step(xs, ys)), steps, warmup=warmup)
    return ms, losses[-1]


def side(rounds, steps, block_warmup, warmup):
    """Every mesh of this job's ranks, interleaved in rounds with the host's figures (module
    docstring); rank 0 reports each round's one-core cluster, reference step, N-rank cluster
    and each mesh's median step and last loss."""
    from mpi4py import MPI

    import raf_dist
    from raf_dist import distributed as dist
    from raf_dist.proxies import calibrate
    from step_time import make

    comm = MPI.COMM_WORLD
    n = comm.size
    config = dist.get_config()

    def trainer_of(rows, local=False):
        module, x, y = make("gpt")
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                                   optimizer=raf_dist.optim.AdamW(lr=1e-3), local=local)
        return trainer, x[rows].numpy(), y[rows].numpy()

    trainers = {}
    for mesh in meshes(n):
        dp, tp, pp, zero, m = mesh
        config.update({"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                       "enable_data_parallel": dp > 1, "zero_opt_level": zero,
                       "num_microbatches": m})
        rank = dist.get_mesh().dp_rank
        trainers[mesh] = trainer_of(slice(rank * GLOBAL_BATCH // dp,
                                          (rank + 1) * GLOBAL_BATCH // dp))
    config.update({"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                   "enable_data_parallel": False, "zero_opt_level": 0, "num_microbatches": 1})
    reference = trainer_of(slice(None), local=True) if comm.rank == 0 else None
    for trainer, xs, ys in trainers.values():
        _timed(trainer, xs, ys, warmup)
    calibrate.alone(comm, lambda: _timed(*reference, warmup))
    order = list(trainers)
    report = []
    for index in range(rounds):
        one_core = calibrate.alone(comm, lambda: (calibrate.measure(MPI.COMM_SELF).to_dict(),
                                         _timed(*reference, block_warmup + steps)))
        cluster = calibrate.measure(comm).to_dict()
        measured, losses = {}, {}
        shift = index % len(order)
        for mesh in order[shift:] + order[:shift]:
            ms, loss = _timed(*trainers[mesh], steps, block_warmup)
            measured[mesh_key(mesh)], losses[mesh_key(mesh)] = ms, loss
        if comm.rank == 0:
            (one, (reference_ms, reference_loss)) = one_core
            # the same data and steps from the same initial values: every mesh's loss is the
            # one-process loss to float32 rounding (the tests check it; printed as a guard)
            losses["1,1,1,0,1"] = reference_loss
            print(f"round {index + 1}/{rounds}: losses {min(losses.values()):.5f}-"
                  f"{max(losses.values()):.5f}", flush=True)
            report.append({"one_core": one, "reference_ms": reference_ms, "cluster": cluster,
                           "ms": measured, "losses": losses})
    if comm.rank == 0:
        harness.report({"ranks": n, "rounds": report})


def gemm_rates(keys, tmp, cpu_set):
    """``Cluster.gemm_efficiency`` of ``keys``: a one-process calibration on ``cpu_set``
    (``calibrate --gemm-shapes``: each matmul shape alone on one core against the 1024^3
    one)."""
    import os
    import subprocess

    from raf_dist.proxies import load_cluster

    path, shapes = Path(tmp) / "cpu-1.json", Path(tmp) / "gemm_shapes.json"
    shapes.write_text(json.dumps(sorted(keys)))
    subprocess.run([harness.mpiexec(), "-n", "1", sys.executable, "-m", "raf_dist.proxies",
                    "calibrate", "--calibration-out", str(path), "--gemm-shapes", str(shapes)],
                   check=True, timeout=600, cwd=harness.ROOT, stdout=subprocess.DEVNULL,
                   preexec_fn=lambda: os.sched_setaffinity(0, cpu_set))
    return load_cluster(str(path)).gemm_efficiency


_WORKLOADS = {}


def workload_of(mesh):
    """The extraction of ``mesh``'s step (once per mesh)."""
    import raf_dist
    from raf_dist.proxies import MeshSpec, extract
    from step_time import make

    if mesh not in _WORKLOADS:
        dp, tp, pp, zero, m = mesh
        module, x, _ = make("gpt")
        model = raf_dist.frontend.from_pytorch(module, (x[:GLOBAL_BATCH // dp],))
        _WORKLOADS[mesh] = extract(model, MeshSpec(dp=dp, tp=tp, pp=pp, zero=zero,
                                                   microbatches=m))
    return _WORKLOADS[mesh]


def predict(mesh, cluster, scale):
    """The simulated step (s) of ``mesh`` on ``cluster``, compute rates times ``scale`` (the
    host's time per operator call as calibrated)."""
    from raf_dist.proxies import simulate

    scaled = dataclasses.replace(cluster, matmul_tflops=cluster.matmul_tflops * scale,
                                 memory_GBps=cluster.memory_GBps * scale)
    return simulate(workload_of(mesh), scaled).iteration_s


def median_cluster(clusters):
    """The field-by-field median of calibrations of one host (links' fields too)."""
    from raf_dist.proxies import Cluster

    dicts = [c.to_dict() for c in clusters]
    out = dict(dicts[0])
    for key, value in dicts[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(d[key] for d in dicts)
        elif key in ("intra", "inter"):
            out[key] = {f: statistics.median(d[key][f] for d in dicts) for f in value}
        elif key == "meeting_groups":  # {group: [ratio, cap]}: each number's median, over
            # the groups every calibration measured
            out[key] = {g: [statistics.median(d[key][g][i] for d in dicts)
                            for i in range(len(pair))] for g, pair in value.items()
                        if all(g in d[key] for d in dicts)}
    return Cluster.from_dict(out)


def matmul_shapes(meshes_):
    """Every matmul shape the extractions of ``meshes_`` run (``Event.gemms``)."""
    return {key for mesh in meshes_ for program in workload_of(mesh).programs
            for e in program for key in e.gemms}


def host_seconds(mesh, cluster):
    """The operator calls' share of ``mesh``'s simulated step on ``cluster`` (pp rank 0)."""
    ops = sum(e.ops for e in workload_of(mesh).programs[0] if e.kind == "compute")
    return ops * cluster.op_overhead_us * 1e-6


SINGLE = (1, 1, 1, 0, 1)
#: how the rows file's N-rank memory rates were calibrated: a rank's share of its core's
#: (calibrate.measure, since stop 62; files without the key: every rank's 64 MiB copies at once)
MEMORY_RATE = "share"


def compute_scale(one_core, reference_s):
    """The compute rates' factor making the one-process step simulated on ``one_core`` (rates,
    matmul shapes, host time per operator call) last ``reference_s`` with its operator calls'
    host time as calibrated (not scaled)."""
    modelled, host = predict(SINGLE, one_core, 1.0), host_seconds(SINGLE, one_core)
    if reference_s <= host:
        raise SystemExit(f"the one-process step ({reference_s * 1e3:.1f} ms) is no longer than "
                         f"its calibrated operator calls ({host * 1e3:.1f} ms): measure again")
    return (modelled - host) / (reference_s - host)


def round_clusters(rnd, efficiency):
    """(one-core cluster, N-rank cluster) of one round, with the matmul shapes' rates."""
    from raf_dist.proxies import Cluster

    return tuple(dataclasses.replace(Cluster.from_dict(rnd[k]), gemm_efficiency=efficiency)
                 for k in ("one_core", "cluster"))


def rows_of(jobs, efficiency):
    """One row per mesh of ``{ranks: [job report]}`` (module docstring): per round the measured
    and predicted step (and the one-matmul-rate prediction), their medians; the planner's
    time under the median of every round's figures."""
    rows = []
    for n, reports in sorted(jobs.items()):
        rounds = [rnd for report in reports for rnd in report["rounds"]]
        clusters = [round_clusters(rnd, efficiency) for rnd in rounds]
        per_round = []
        for rnd, (one, cluster) in zip(rounds, clusters):
            flat_one, flat = round_clusters(rnd, {})
            per_round.append((rnd, cluster, compute_scale(one, rnd["reference_ms"] / 1e3),
                              flat, compute_scale(flat_one, rnd["reference_ms"] / 1e3)))
        plan_one = median_cluster([one for one, _ in clusters])
        plan_cluster = median_cluster([cluster for _, cluster in clusters])
        plan_scale = compute_scale(plan_one, statistics.median(r["reference_ms"]
                                                               for r in rounds) / 1e3)
        for mesh in meshes(n):
            key = mesh_key(mesh)
            measured = [rnd["ms"][key] for rnd, *_ in per_round]
            predicted = [predict(mesh, c, scale) * 1e3 for _, c, scale, _, _ in per_round]
            one_rate = [predict(mesh, f, scale) * 1e3 for *_, f, scale in per_round]
            dp, tp, pp, zero, m = mesh
            rows.append({"ranks": n, "dp": dp, "tp": tp, "pp": pp, "zero": zero,
                         "microbatches": m, "measured": measured, "predicted": predicted,
                         "measured_ms": statistics.median(measured),
                         "predicted_ms": statistics.median(predicted),
                         "one_rate_ms": statistics.median(one_rate),
                         "planned_ms": predict(mesh, plan_cluster, plan_scale) * 1e3})
    return rows


def _name(r):
    return f"dp{r['dp']} tp{r['tp']} pp{r['pp']} zero{r['zero']} M{r['microbatches']}"


def print_rounds(jobs):
    """Each rank count's rounds: the reference, the compute rates alone and shared, the host
    time per operator call alone and shared, the allreduce's alpha, the meeting figures, and
    the range of the meshes' losses (equal but for float32 rounding: a guard)."""
    for n, reports in sorted(jobs.items()):
        for j, report in enumerate(reports):
            for i, rnd in enumerate(report["rounds"]):
                c, one = rnd["cluster"], rnd["one_core"]
                groups = " ".join(f"{g} {v[0]:.2f}" for g, v in
                                  sorted(c.get("meeting_groups", {}).items()))
                print(f"# N={n} job {j + 1} round {i + 1}: one core {rnd['reference_ms']:.1f} "
                      f"ms, {one['matmul_tflops'] * 1e3:.1f} GFLOP/s alone, "
                      f"{c['matmul_tflops'] * 1e3:.1f} shared, op {one['op_overhead_us']:.1f} / "
                      f"{c['op_overhead_us']:.1f} us, alpha {c['intra']['alpha_us']:.0f} us, "
                      f"meeting {c['meeting_us']:.0f} us; lateness {groups}; losses "
                      f"{min(rnd['losses'].values()):.5f}-{max(rnd['losses'].values()):.5f}",
                      flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--side", action="store_true")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per job: the host's figures, then every mesh's block of steps")
    p.add_argument("--steps", type=int, default=10, help="timed steps of a mesh per round")
    p.add_argument("--block-warmup", type=int, default=2,
                   help="untimed steps of a mesh at the start of its block")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps of each Trainer "
                   "before the first round")
    p.add_argument("--repeats", type=int, default=2,
                   help="jobs per rank count; a row is the median over all their rounds")
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--png", default=str(harness.BENCH / "plan_validation.png"))
    p.add_argument("--rows-out", default="/tmp/plan_validation_rows.json")
    p.add_argument("--predict-only", help="a previous run's --rows-out: predict again")
    p.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                   help="bind each rank to one core: harness.BIND (--no-bind: leave them to "
                        "the scheduler)")
    a = p.parse_args()
    if a.side:
        side(a.rounds, a.steps, a.block_warmup, a.warmup)
        return
    if a.repeats < 1 or a.rounds < 1 or a.steps < 1:
        raise SystemExit(f"--repeats {a.repeats} / --rounds {a.rounds} / --steps {a.steps}: "
                         "at least one of each")
    import tempfile

    tmp = tempfile.mkdtemp(prefix="raf_dist_pv_")
    ranks = [int(v) for v in a.ranks.split(",")]
    one_core = harness.cores(1)
    keys = matmul_shapes([SINGLE, *(m for n in ranks for m in meshes(n))])
    if a.predict_only:
        saved = json.loads(Path(a.predict_only).read_text())
        if "jobs" not in saved:
            raise SystemExit(f"{a.predict_only} is a rows file from before the interleaved "
                             "jobs (2026-11-30, stop 62): it has no per-round figures to "
                             "predict from; measure again without --predict-only")
        jobs = {int(n): reports for n, reports in saved["jobs"].items() if int(n) in ranks}
        if saved.get("memory_rate") != MEMORY_RATE:
            # measured before calibrate's memory rate was the rank's share of its core's:
            # the same figure from the round's own one-core copy and both GEMM rates
            print("# rows from before the memory rate by share (stop 62): each round's N-rank "
                  "memory rate = its one-core copy rate x shared / alone GEMM rate", flush=True)
            for report in (r for reports in jobs.values() for r in reports):
                for rnd in report["rounds"]:
                    one, cluster = rnd["one_core"], rnd["cluster"]
                    cluster["memory_GBps"] = (one["memory_GBps"] * cluster["matmul_tflops"]
                                              / one["matmul_tflops"])
        efficiency = saved["gemm_efficiency"]
        if not keys <= set(efficiency):  # the extractions run a shape the file has no rate for
            print(f"# measuring the matmul shapes again ({len(keys - set(efficiency))} new)",
                  flush=True)
            efficiency = gemm_rates(keys, tmp, one_core)
        a.bind = saved["bind"]
    else:
        # every matmul shape's rate against the 1024^3 one, alone on one core as every rank
        # computes (Cluster.gemm_efficiency; a ratio, measured once)
        efficiency = gemm_rates(keys, tmp, one_core)
        jobs = {}
        bind = harness.BIND if a.bind else []
        for repeat in range(a.repeats):
            for n in ranks:
                began = time.time()
                report = harness.run_side(
                    [harness.mpiexec(), *bind, "-n", str(n), sys.executable, __file__,
                     "--side", "--rounds", str(a.rounds), "--steps", str(a.steps),
                     "--block-warmup", str(a.block_warmup), "--warmup", str(a.warmup)],
                    timeout=3600)
                jobs.setdefault(n, []).append(report)
                print(f"# job {repeat + 1}/{a.repeats} N={n}: {time.time() - began:.0f} s",
                      flush=True)
                # written after every job: a run stopped half-way leaves its rows
                Path(a.rows_out).write_text(json.dumps({"bind": a.bind, "jobs": jobs,
                                                        "gemm_efficiency": efficiency,
                                                        "memory_rate": MEMORY_RATE}))
    print(f"# {harness.machine()}; ranks bound: {a.bind}", flush=True)
    print(f"# {len(efficiency)} matmul shapes measured: rate / the 1024^3 one's from "
          f"{min(efficiency.values()):.2f} to {max(efficiency.values()):.2f} (median "
          f"{statistics.median(efficiency.values()):.2f})", flush=True)
    print_rounds(jobs)
    rows = rows_of(jobs, efficiency)
    print("ranks  dp  tp  pp  zero   M  measured ms (rounds' range)  predicted ms   error "
          "(rounds' errors)  planned ms | one matmul rate: predicted  error")
    for r in rows:
        err = r["predicted_ms"] / r["measured_ms"] - 1
        flat_err = r["one_rate_ms"] / r["measured_ms"] - 1
        errors = [q / m - 1 for q, m in zip(r["predicted"], r["measured"])]
        span = f"({min(r['measured']):.0f}-{max(r['measured']):.0f})"
        print(f"{r['ranks']:>5} {r['dp']:>3} {r['tp']:>3} {r['pp']:>3} {r['zero']:>5} "
              f"{r['microbatches']:>3} {r['measured_ms']:>12.1f} {span:>15} "
              f"{r['predicted_ms']:>13.1f} {err:>+7.1%} ({min(errors):+.0%}..{max(errors):+.0%})"
              f" {r['planned_ms']:>11.1f} | {r['one_rate_ms']:>26.1f} {flat_err:>+6.1%}")
    within = [abs(r["predicted_ms"] / r["measured_ms"] - 1) <= 0.2 for r in rows]
    flat_within = [abs(r["one_rate_ms"] / r["measured_ms"] - 1) <= 0.2 for r in rows]
    spread = statistics.median((max(r["measured"]) - min(r["measured"])) / r["measured_ms"]
                               for r in rows)
    print(f"within 20%: {sum(within)} of {len(rows)} (one matmul rate: {sum(flat_within)}); "
          f"a row's measured rounds span {spread:.0%} of its median (median over the rows)")
    for n in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == n]
        # as raf_dist.tools.plan ranks: by simulated time, at equal time the smaller
        # footprint (here: the higher ZeRO level of one mesh; ZeRO-1 and -2 run one step)
        first = min(mine, key=lambda r: (round(r["planned_ms"], 6), -r["zero"]))
        fastest = sorted(mine, key=lambda r: r["measured_ms"])[:2]
        names = ", ".join(_name(r) for r in fastest)
        median = statistics.median(r["measured_ms"] for r in mine)
        print(f"N={n}: fastest predicted {_name(first)} ({first['measured_ms']:.1f} ms "
              f"measured) {'IS' if first in fastest else 'is NOT'} among the two fastest "
              f"measured ({names}; median of the {len(mine)} meshes {median:.1f} ms)")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for n, marker in ((2, "o"), (4, "s"), (8, "^")):
        mine = [r for r in rows if r["ranks"] == n]
        if not mine:
            continue
        ax.errorbar([r["measured_ms"] for r in mine], [r["predicted_ms"] for r in mine],
                    xerr=[[r["measured_ms"] - min(r["measured"]) for r in mine],
                          [max(r["measured"]) - r["measured_ms"] for r in mine]],
                    fmt=marker, capsize=2, label=f"{n} ranks")
    top = max(max(*r["measured"], r["predicted_ms"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.plot([0, top], [0, 1.2 * top], "k:", lw=0.6)
    ax.plot([0, top], [0, 0.8 * top], "k:", lw=0.6)
    ax.set_xlabel("measured step (ms; bars: the rounds' range)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("predicted (raf_dist.proxies) vs measured, GPT 4x128, here")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"scatter: {a.png}")


if __name__ == "__main__":
    main()
