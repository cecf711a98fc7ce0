"""The planner's predictions against measured steps on this machine (issue #33's proof).

    .venv/bin/python bench/plan_validation.py [--ranks 2,4,8] [--repeats 3]
        [--calibrations 3] [--steps 30] [--warmup 15] [--no-bind] [--png out.png]

Model: bench/step_time.py's GPT (4 layers, d 128, 4 heads, seq 64, vocab 512), global batch
16, AdamW. For every mesh of 2, 4 and 8 ranks (dp, tp, pp and their products; ZeRO 0-3 on
the pure dp meshes; 2 x pp microbatches under pipelining) ``--repeats`` ``mpiexec -n N`` jobs
train it, minutes apart (the repeats are the outer loop), each rank bound to one core
(``harness.BIND``; the calibrations too; ``--no-bind`` leaves them to the scheduler); a job
reports the median of ``--steps`` steps after ``--warmup`` steps, rank 0's clock (every step
ends in the loss allreduce; with more ranks than cores a job's first ~15 steps run 10-30%
slower than its later ones, bench/RESULTS.md "Steady steps", which the default warm-up
passes), and the mesh's row is the median job (one job of a mesh swung by up to 40%
between runs here). The driver predicts it: raf_dist.proxies' extraction of that mesh's
step simulated on this machine's cluster description.

The cluster of an N-rank run is this machine measured with N ranks sharing its cores
(``mpiexec -n N python -m raf_dist.proxies calibrate``: each rank's GEMM and copy rates while
the others run theirs, on the threads a Trainer gives it, raf_dist's allreduce alpha and
bandwidth between them, a meeting's lateness for each group shape the meshes meet in
(``Cluster.meeting_groups``); the field-by-field median of ``--calibrations`` of them, as one
calibration's lateness cap and host time per collective swing 2-3x), every matmul shape of
the meshes' steps measured alone on one core against the 1024^3 GEMM (``calibrate
--gemm-shapes``: ``Cluster.gemm_efficiency``, which each N-rank cluster shares), and the model's compute scaled so that the simulated
one-process step equals the measured one-process step, both on one core (``-n 1``
calibration; every rank of these jobs computes on one thread) (the issue's "this machine's
measured kernel times scaled"); that one-process step is measured again just before each
job and the mesh predicted at its jobs' median (this shared host's speed drifts by tens of
percent within minutes); the host time per operator call is the calibration's,
measured with N ranks stepping at once, not scaled. Nothing is fitted per mesh.
``--predict-only FILE`` predicts again the meshes a previous run measured (its
``--rows-out``, written after every job; the one-core reference and the calibrations are
measured again).
Prints the table (with what one matmul rate for every shape would predict, the model before
the shapes were measured), the share of meshes predicted within 20%, whether the planner's
first choice among the measured meshes (ranked as raf_dist.tools.plan ranks: by this
simulation, every mesh at the run's first reference speed, at equal time the smaller
footprint) is among the two fastest measured, and draws the scatter.
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


def side(tp, pp, zero, microbatches, steps, warmup):
    """One mesh on this job's ranks: prints rank 0's median step."""
    import raf_dist
    from raf_dist import distributed as dist
    from step_time import make

    comm = dist.get_communicator()
    dp = comm.size // (tp * pp)
    dist.get_config().update({"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                              "enable_data_parallel": dp > 1, "zero_opt_level": zero,
                              "num_microbatches": microbatches})
    mesh = dist.get_mesh()
    module, x, y = make("gpt")
    rows = slice(mesh.dp_rank * GLOBAL_BATCH // dp, (mesh.dp_rank + 1) * GLOBAL_BATCH // dp)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x[rows],)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3))
    xs, ys = x[rows].numpy(), y[rows].numpy()
    ms = harness.median_ms(lambda: trainer.step(xs, ys), steps, warmup=warmup)
    if comm.rank == 0:
        harness.report({"ms": ms})


def calibrated(n, tmp, cpu_set=None, bind=(), gemm_keys=()):
    """This machine measured with ``n`` ranks sharing its cores (module docstring), on
    ``cpu_set`` when given, with the launcher's ``bind`` flags; with ``gemm_keys``, those
    matmuls' rates too (``Cluster.gemm_efficiency``)."""
    import os
    import subprocess

    from raf_dist.proxies import load_cluster

    path = Path(tmp) / f"cpu-{n}.json"
    shapes = []
    if gemm_keys:
        keys = Path(tmp) / "gemm_shapes.json"
        keys.write_text(json.dumps(sorted(gemm_keys)))
        shapes = ["--gemm-shapes", str(keys)]
    subprocess.run([harness.mpiexec(), *bind, "-n", str(n), sys.executable, "-m",
                    "raf_dist.proxies", "calibrate", "--calibration-out", str(path), *shapes],
                   check=True, timeout=600,
                   cwd=harness.ROOT, stdout=subprocess.DEVNULL,
                   preexec_fn=(lambda: os.sched_setaffinity(0, cpu_set)) if cpu_set else None)
    return load_cluster(str(path))


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


def rows_of(jobs):
    """One row per mesh of ``{(ranks, *mesh): [job]}``: the median job, and the median
    reference (the speed the host ran them at)."""
    return [{"ranks": n, "dp": dp, "tp": tp, "pp": pp, "zero": zero, "microbatches": m,
             "measured_ms": statistics.median(j["measured_ms"] for j in mine),
             "reference_ms": statistics.median(j["reference_ms"] for j in mine), "jobs": mine}
            for (n, dp, tp, pp, zero, m), mine in jobs.items()]


def _name(r):
    return f"dp{r['dp']} tp{r['tp']} pp{r['pp']} zero{r['zero']} M{r['microbatches']}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--side", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--repeats", type=int, default=3,
                   help="jobs per mesh; a row is their median")
    p.add_argument("--calibrations", type=int, default=3,
                   help="calibrations per rank count; the cluster is their median")
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--png", default=str(harness.BENCH / "plan_validation.png"))
    p.add_argument("--rows-out", default="/tmp/plan_validation_rows.json")
    p.add_argument("--predict-only", help="a previous run's --rows-out: predict again")
    p.add_argument("--bind", action=argparse.BooleanOptionalAction, default=True,
                   help="bind each rank to one core (jobs and calibrations): harness.BIND "
                        "(--no-bind: leave them to the scheduler)")
    a = p.parse_args()
    if a.side:
        side(a.tp, a.pp, a.zero, a.microbatches, a.steps, a.warmup)
        return
    if a.repeats < 1 or a.calibrations < 1:
        raise SystemExit(f"--repeats {a.repeats} / --calibrations {a.calibrations}: at least "
                         "one of each")
    import tempfile

    tmp = tempfile.mkdtemp(prefix="raf_dist_pv_")
    ranks = [int(v) for v in a.ranks.split(",")]
    # the reference: one process on one core, as every rank of the 2-, 4- and 8-rank jobs
    # computes on one thread (cores / ranks); two threads in one process are a different
    # kernel efficiency (TVM's pool synchronises every parallel kernel) that no mesh here has
    one_core = harness.cores(1)

    def reference():
        return harness.run_side([sys.executable, __file__, "--side", "--steps", str(a.steps),
                                 "--warmup", str(a.warmup)], cpu_set=one_core,
                                timeout=900)["ms"] / 1e3

    one = reference()
    first_one = one  # the speed the planner's ranking is taken at: the run's first reference
    rows = []
    if a.predict_only:
        saved = json.loads(Path(a.predict_only).read_text())
        rows = [r for r in saved["rows"] if r["ranks"] in ranks]
        first_one = saved["one_process_s"]
        # calibrated as those jobs ran (files from before f898af9 have no key: unbound)
        a.bind = saved.get("bind", False)
    bind = harness.BIND if a.bind else []
    single = (1, 1, 1, 0, 1)
    measured_meshes = ([(r["dp"], r["tp"], r["pp"], r["zero"], r["microbatches"]) for r in rows]
                       if a.predict_only else [m for n in ranks for m in meshes(n)])
    # the matmuls' rates by shape, measured alone on one core as every rank computes (each
    # N-rank calibration's matmul rate carries the sharing of cores; the shapes' rates are
    # relative to it: Cluster.gemm_efficiency)
    clusters = {1: calibrated(1, tmp, one_core,
                              gemm_keys=matmul_shapes([single, *measured_meshes]))}
    # each N-rank cluster the median of --calibrations calibrations, field by field: one
    # calibration's lateness cap and host time per collective swung 2-3x between
    # calibrations minutes apart (bench/RESULTS.md)
    clusters.update({n: dataclasses.replace(
        median_cluster([calibrated(n, tmp, bind=bind) for _ in range(a.calibrations)]),
        gemm_efficiency=clusters[1].gemm_efficiency) for n in ranks})
    print(f"# {harness.machine()}", flush=True)
    for n, c in clusters.items():
        shown = {k: v for k, v in c.to_dict().items() if k != "gemm_efficiency"}
        print(f"# calibrated with {n} rank(s): {json.dumps(shown)}", flush=True)
    efficiency = clusters[1].gemm_efficiency
    if efficiency:
        print(f"# {len(efficiency)} matmul shapes measured: rate / the 1024^3 one's from "
              f"{min(efficiency.values()):.2f} to {max(efficiency.values()):.2f} (median "
              f"{statistics.median(efficiency.values()):.2f})", flush=True)
    # the rates scaled so that the one-process step's compute plus its operator calls' host
    # time (calibrated, not scaled) equals the measured one-process step
    modelled, host = predict(single, clusters[1], 1.0), host_seconds(single, clusters[1])
    # the same without the shapes' rates (every matmul at the 1024^3 rate, as before
    # 2026-11-30): the table's "one rate" column
    flat = {n: dataclasses.replace(c, gemm_efficiency={}) for n, c in clusters.items()}
    flat_modelled = predict(single, flat[1], 1.0)

    def scale_for(reference_s, modelled_s=modelled):
        """The compute rates' factor making the one-process step ``modelled_s`` (this model's,
        or the one-rate model's) last ``reference_s``."""
        if reference_s <= host:
            raise SystemExit(f"the one-process step ({reference_s * 1e3:.1f} ms) is no longer "
                             f"than its calibrated operator calls ({host * 1e3:.1f} ms): "
                             "calibrate again")
        return (modelled_s - host) / (reference_s - host)

    scale = scale_for(one)
    print(f"# one process on one core: measured {one * 1e3:.1f} ms, cost model "
          f"{modelled * 1e3:.1f} ms "
          f"(of which {host * 1e3:.1f} ms the host's operator calls) -> this model's compute "
          f"rates x {scale:.3f}", flush=True)
    if not a.predict_only:
        # each mesh in --repeats jobs, the repeats as the outer loop (a mesh's jobs minutes
        # apart): one job of a mesh measured 81-115 ms here in four runs (bench/RESULTS.md)
        jobs = {}
        for repeat in range(a.repeats):
            for n in ranks:
                for mesh in meshes(n):
                    dp, tp, pp, zero, m = mesh
                    # the one-core reference again, just before the job: this shared host's
                    # speed drifts (the same reference measured 112.5 and 69.5 ms 25 minutes
                    # apart, 2026-11-29), and the job is predicted at the speed of its moment
                    ref = reference()
                    measured = harness.run_side(
                        [harness.mpiexec(), *bind, "-n", str(n), sys.executable, __file__,
                         "--side", "--tp", str(tp), "--pp", str(pp), "--zero", str(zero),
                         "--microbatches", str(m), "--steps", str(a.steps), "--warmup",
                         str(a.warmup)],
                        timeout=900)["ms"] / 1e3
                    jobs.setdefault((n, *mesh), []).append(
                        {"measured_ms": measured * 1e3, "reference_ms": ref * 1e3})
                    print(f"# job {repeat + 1}/{a.repeats} N={n} dp{dp} tp{tp} pp{pp} zero{zero} "
                          f"M{m}: measured {measured * 1e3:.1f} ms (one core just before: "
                          f"{ref * 1e3:.1f} ms)", flush=True)
                    # written after every job: a run stopped half-way leaves its rows
                    rows = rows_of(jobs)
                    Path(a.rows_out).write_text(json.dumps({"one_process_s": one,
                                                            "bind": a.bind, "rows": rows}))
    # the planner's view: every mesh at one speed of the host (the run's first reference), as
    # it ranks them under one cluster description
    plan_scale = scale_for(first_one)
    for r in rows:
        mesh = (r["dp"], r["tp"], r["pp"], r["zero"], r["microbatches"])
        row_scale = scale_for(r["reference_ms"] / 1e3) if "reference_ms" in r else scale
        r["predicted_ms"] = predict(mesh, clusters[r["ranks"]], row_scale) * 1e3
        r["planned_ms"] = predict(mesh, clusters[r["ranks"]], plan_scale) * 1e3
        r["one_rate_ms"] = predict(mesh, flat[r["ranks"]], scale_for(
            r.get("reference_ms", one * 1e3) / 1e3, flat_modelled)) * 1e3
    print("ranks  dp  tp  pp  zero   M  measured ms (jobs' range)  predicted ms   error  "
          "planned ms | one matmul rate: predicted  error")
    for r in rows:
        err = r["predicted_ms"] / r["measured_ms"] - 1
        flat_err = r["one_rate_ms"] / r["measured_ms"] - 1
        spread = [j["measured_ms"] for j in r.get("jobs", [])]
        spread = f"({min(spread):.0f}-{max(spread):.0f})" if len(spread) > 1 else ""
        print(f"{r['ranks']:>5} {r['dp']:>3} {r['tp']:>3} {r['pp']:>3} {r['zero']:>5} "
              f"{r['microbatches']:>3} {r['measured_ms']:>12.1f} {spread:>13} "
              f"{r['predicted_ms']:>13.1f} "
              f"{err:>+7.1%} {r['planned_ms']:>11.1f} | {r['one_rate_ms']:>26.1f} "
              f"{flat_err:>+6.1%}")
    within = [abs(r["predicted_ms"] / r["measured_ms"] - 1) <= 0.2 for r in rows]
    flat_within = [abs(r["one_rate_ms"] / r["measured_ms"] - 1) <= 0.2 for r in rows]
    print(f"within 20%: {sum(within)} of {len(rows)} (one matmul rate: {sum(flat_within)})")
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
        ax.scatter([r["measured_ms"] for r in mine], [r["predicted_ms"] for r in mine],
                   marker=marker, label=f"{n} ranks")
    top = max(max(r["measured_ms"], r["predicted_ms"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.plot([0, top], [0, 1.2 * top], "k:", lw=0.6)
    ax.plot([0, top], [0, 0.8 * top], "k:", lw=0.6)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("predicted (raf_dist.proxies) vs measured, GPT 4x128, here")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"scatter: {a.png}")


if __name__ == "__main__":
    main()
