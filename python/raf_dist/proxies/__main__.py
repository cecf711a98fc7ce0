"""``mpirun -np N python -m raf_dist.proxies gpt2|gpt3|dlrm|cosmoflow [options]``: replay a
workload's communication (extracted from raf_dist's compiled step; proxies/extract.py) with
its compute slept, and print per-iteration time and per-collective totals.
``python -m raf_dist.proxies WORKLOAD --simulate --world N [--cluster dgx-a100]``: the same
workload on N virtual ranks of a cluster (proxies/simulate.py), one process.
``mpirun -np 2 python -m raf_dist.proxies calibrate``: measure this machine for the
``cpu-here`` cluster."""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time

from .presets import PRESETS, WORKLOADS, cosmoflow_workload
from .simulate import CALIBRATION_PATH, CLUSTERS, load_cluster, simulate
from .workload import Workload


def _parser():
    p = argparse.ArgumentParser(prog="python -m raf_dist.proxies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=WORKLOADS + ("calibrate",))
    p.add_argument("--layers", type=int, help="transformer layers (gpt2 48, gpt3 96)")
    p.add_argument("--stages", type=int, help="pipeline stages (gpt2 4, gpt3 = layers)")
    p.add_argument("--microbatches", type=int, help="gpt2 8, gpt3 2 x stages")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks (gpt3 4; gpt2 and dlrm "
                                          "1; cosmoflow: the spatial split, 4)")
    p.add_argument("--dp", type=int, help="data-parallel replicas (default: what the world "
                                          "leaves)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per microbatch (default 1; dlrm: samples per rank, "
                        "2048 / ranks)")
    p.add_argument("--bucket-mb", type=float, help="gradient bucket (gpt2: one layer)")
    p.add_argument("--embedding-parallel", choices=("table", "row"), help="dlrm (table)")
    p.add_argument("--recompute", default="none", choices=("none", "full", "selective"),
                   help="activation recomputation (pipelines: full or none)")
    p.add_argument("--vocab", type=int, help="gpt2 / gpt3 vocabulary (50257)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "16-bit"),
                   help="16-bit: messages and memory traffic as a bf16 / fp16 run moves "
                        "them (Workload.in_16_bit)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cluster", default="cpu-here",
                   help=f"compute and network model: {', '.join(CLUSTERS)} or a JSON file")
    p.add_argument("--max-buffer-mb", type=float, default=64.0,
                   help="largest scratch buffer per role; bigger messages go in chunks")
    p.add_argument("--simulate", action="store_true", help="one process, N virtual ranks")
    p.add_argument("--world", type=int, help="ranks to simulate (with --simulate)")
    p.add_argument("--list", action="store_true", help="also print pp rank 0's events")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--calibration-out", help="calibrate: where to write the cluster JSON "
                                             "(default: cpu-here's saved calibration)")
    p.add_argument("--gemm-shapes", help="calibrate: a JSON list of matmul shapes (gemm_key, "
                                         "as a workload's compute events list them) whose "
                                         "rates to measure too (Cluster.gemm_efficiency)")
    return p


def build_workload(args, world: int) -> tuple[Workload, list]:
    """(workload, the C++ proxy's message list) for ``args`` on ``world`` ranks."""
    args = copy.copy(args)  # the defaults filled in below are this call's
    args.micro_batch_set = args.micro_batch is not None
    args.micro_batch = args.micro_batch or 1
    if args.workload == "cosmoflow":
        spatial = args.tp or 4
        if world % spatial:
            raise SystemExit(f"cosmoflow splits each sample {spatial} ways: the world ({world}) "
                             "must be a multiple of --tp")
        return cosmoflow_workload(world // spatial, spatial, args.micro_batch), []
    from .extract import extract

    preset = PRESETS[args.workload]
    if args.workload == "gpt3":
        tp = args.tp or 4
        stages = args.stages or args.layers or 96
    elif args.workload == "gpt2":
        tp, stages = args.tp or 1, args.stages or 4
    elif args.workload == "dlrm":  # (--tp: the MLPs split, the tables sharded over dp)
        tp, stages = args.tp or 1, 1
    else:
        tp, stages = 1, 1
    if world % (tp * stages):
        raise SystemExit(f"{world} ranks do not split into tp {tp} x pp {stages}: use a "
                         f"multiple of {tp * stages} ranks, or other --tp / --stages")
    args.dp = args.dp or world // (tp * stages)
    if args.dp * tp * stages != world:
        raise SystemExit(f"--dp {args.dp} x tp {tp} x pp {stages} is not the world ({world})")
    model, mesh, loss = preset.build(args)
    workload = extract(model, mesh, loss=loss, name=args.workload)
    if getattr(args, "precision", "fp32") == "16-bit":
        workload = workload.in_16_bit()
    return workload, preset.spcl(args)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f}"


def report_text(workload: Workload, spcl, measured, simulated, cluster, extract_s) -> str:
    lines = [f"# {workload.name}: dp {workload.dp} x tp {workload.tp} x pp {workload.pp} = "
             f"{workload.world} ranks, {workload.microbatches} microbatch(es), schedule "
             f"{workload.schedule}, ZeRO {workload.zero}; cluster {cluster.name}",
             f"# {workload.source}" + (f"; extracted in {extract_s:.1f} s" if extract_s else "")]
    if spcl:
        lines.append("# the C++ proxy's messages (floats) vs this extraction's, pp rank 0 "
                     "unless said:")
        for what, floats, count in spcl:
            lines.append(f"#   spcl: {count:>4} x {floats:>13,} floats  {what}")
        for r in sorted({0, workload.pp - 1}):
            sizes: dict[tuple[str, str, int], int] = {}
            for e in workload.collectives(r):
                key = (e.kind, e.axis, e.bytes // 4)
                sizes[key] = sizes.get(key, 0) + 1
            for (kind, axis, floats), count in sorted(sizes.items(), key=lambda kv: -kv[0][2]):
                lines.append(f"#   ours pp{r}: {count:>4} x {floats:>13,} floats  {kind} "
                             f"over {axis}")
    if measured is not None:
        lines.append(f"measured iteration: median {measured['iteration_s'] * 1e3:.2f} ms "
                     f"[{measured['min_s'] * 1e3:.2f}-{measured['max_s'] * 1e3:.2f}] over "
                     f"{measured['iters']} iterations after {measured['warmup']} warm-up")
        rows = {}
        for r in measured["per_rank"]:
            for k, v in r["by_kind"].items():
                row = rows.setdefault(k, [0, 0, 0.0, 0])
                row[0] += v["count"]
                row[1] += v["bytes"]
                row[2] += v["seconds"]
                row[3] += 1
        n = max(1, measured["iters"])
        lines.append("kind             calls/iter   MB/iter   waited ms/iter (mean over ranks)")
        for k, (count, nbytes, seconds, ranks) in sorted(rows.items()):
            lines.append(f"{k:<16} {count / n / ranks:>10.1f} {_mb(nbytes / n / ranks):>9} "
                         f"{seconds / n / ranks * 1e3:>12.3f}")
        compute = max(r["compute_s"] for r in measured["per_rank"])
        waited = max(r["waited_s"] for r in measured["per_rank"])
        lines.append(f"compute slept {compute * 1e3:.2f} ms, communication waited "
                     f"{waited * 1e3:.2f} ms (slowest rank) of {measured['iteration_s'] * 1e3:.2f}"
                     " ms")
    if simulated is not None:
        lines.append(f"simulated on {cluster.name}: iteration {simulated.iteration_s * 1e3:.2f} "
                     f"ms, idle share of the slowest stage {simulated.bubble:.1%}, "
                     f"{workload.device_flops() / simulated.iteration_s / 1e12:.1f} TFLOP/s "
                     "per device (matmul FLOPs, recomputation included)")
        lines.append("kind             count      MB          ms (pp rank 0's collectives, "
                     "every rank's messages)")
        for k, v in sorted(simulated.by_kind.items()):
            lines.append(f"{k:<16} {v['count']:>5} {_mb(v['bytes']):>11} "
                         f"{v['seconds'] * 1e3:>11.3f}")
        P = len(simulated.per_rank)
        for r, s in enumerate(simulated.per_rank):
            if 3 <= r < P - 2:  # the first three and the last two stages
                if r == 3:
                    lines.append(f"  ... ({P - 5} more stages)")
                continue
            hidden = 1 - s["exposed_s"] / s["comm_s"] if s["comm_s"] else 1.0
            lines.append(f"  pp{r}: compute {s['compute_s'] * 1e3:.2f} ms, collectives "
                         f"{s['comm_s'] * 1e3:.2f} ms of which {hidden:.0%} overlapped with "
                         f"compute, waiting for other stages {s['pipeline_wait_s'] * 1e3:.2f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.workload == "calibrate":
        from .calibrate import calibrate

        keys = ()
        if args.gemm_shapes:
            with open(args.gemm_shapes) as f:
                keys = json.load(f)
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise SystemExit(f"--gemm-shapes {args.gemm_shapes}: expected a JSON list of "
                                 'matmul shapes such as "256x128,512x128,01"')
            from .workload import parse_gemm_key

            for key in keys:  # every key checked before any rank measures anything
                try:
                    parse_gemm_key(key)
                except ValueError as e:
                    raise SystemExit(f"--gemm-shapes {args.gemm_shapes}: {e}") from None
        return calibrate(args.calibration_out or CALIBRATION_PATH, keys)
    cluster = load_cluster(args.cluster)
    if args.simulate:
        if not args.world:
            raise SystemExit("--simulate needs --world N (the ranks to simulate)")
        began = time.perf_counter()
        workload, spcl = build_workload(args, args.world)
        extracted = time.perf_counter() - began
        result = simulate(workload, cluster)
        if args.json:
            print(json.dumps({"iteration_s": result.iteration_s, "by_kind": result.by_kind,
                              "per_rank": result.per_rank}))
        else:
            print(report_text(workload, spcl, None, result, cluster, extracted))
            if args.list:
                print("\n".join(str(e.to_dict()) for e in workload.programs[0]))
        return 0
    from mpi4py import MPI

    from .replay import replay

    comm = MPI.COMM_WORLD
    text = spcl = None
    extracted = 0.0
    if comm.rank == 0:  # one process extracts; the replay ranks compile nothing
        began = time.perf_counter()
        try:
            workload, spcl = build_workload(args, comm.size)
            text = workload.to_json()
        except (SystemExit, ValueError, NotImplementedError) as e:  # every rank stops
            text = f"ERROR {e}"
        extracted = time.perf_counter() - began
    # the others wait for rank 0's extraction asleep (a blocking broadcast spins in MPICH,
    # taking the cores the extraction needs when ranks outnumber them)
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)
    text = comm.bcast(text, root=0)
    if text.startswith("ERROR "):
        if comm.rank == 0:
            print(text[6:], file=sys.stderr)
        return 2
    workload = Workload.from_json(text)
    measured = replay(workload, cluster, args.iters, args.warmup, args.max_buffer_mb)
    if comm.rank == 0:
        simulated = simulate(workload, cluster)
        if args.json:
            print(json.dumps({"measured": measured, "simulated_iteration_s":
                              simulated.iteration_s}))
        else:
            print(report_text(workload, spcl, measured, simulated, cluster, extracted))
            if args.list:
                print("\n".join(str(e.to_dict()) for e in workload.programs[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
