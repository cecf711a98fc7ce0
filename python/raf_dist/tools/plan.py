"""Choose a mesh for a cluster: ``python -m raf_dist.tools.plan --model NAME|script.py:fn
--devices N --device-memory-gb G --global-batch B [--seq S] [--cluster NAME|file.json]
[--json]``.

For every dp x tp x pp that divides N (tp within a node and dividing the model's heads), ZeRO
level, microbatch count and recomputation policy the Trainer accepts (under pipelining also
``activation_memory_budget_mb``'s per-stage choice, a ``budget`` row, where no recomputation
does not fit: ``stage_levels``):

- memory per device: the model states this rank holds (raf_dist.layout's StateLayout: the
  same padded shards the Trainer holds, for the parameters of its tp piece and pipeline
  stages, AdamW's two states) plus the activations a step keeps: the values of the stage's
  forward kept per microbatch (all of them without recomputation; with it, what
  passes/remat.py or the pipeline's checkpointing keeps) times the microbatches in flight on
  that stage (1F1B: min(P - s, M)), plus what one backward recomputes (``activation_bytes``),
  plus under pipelining the stage-boundary messages a rank holds through a step (every
  receive posted first, every sent message kept to the step's end, as
  runtime/stage_budget.py models the Trainer's: ``boundary_bytes``);
- step time: first a quick estimate (FLOPs at the cluster's rate, the pipeline bubble
  (P - 1) / M, the gradient reduction's ring time) that orders the configurations that fit,
  then, in that order and while ``--budget-s`` lasts, raf_dist.proxies' extraction of the
  configuration's real step (the collectives the passes insert, the schedule's messages)
  simulated on the cluster (compute + communication not hidden by overlap + bubble). The
  ``how`` column says which a row has.

Models: ``gpt3-175b``, ``gpt2-xl``, ``gpt2``, ``llama3-8b`` (raf_dist.proxies.models, shapes
only) or ``script.py:fn`` whose ``fn()`` returns (torch module, example inputs for the global
batch), loss cross-entropy. ``--precision 16-bit`` models a bf16 / fp16 run's bytes
(Workload.in_16_bit; optimizer state float32).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

STATES_PER_PARAM = 2  # AdamW


@dataclasses.dataclass
class Choice:
    dp: int
    tp: int
    pp: int
    zero: int
    microbatches: int
    recompute: str
    memory_per_device_gb: float = 0.0
    fits: bool = False
    step_time_s: float = math.inf
    comm_bytes_per_step: int = 0
    how: str = ""
    #: recompute "budget" (pp > 1): each stage's level, as the Trainer's
    #: activation_memory_budget_mb chooses them, and the budget to set (MB per device)
    stage_recompute: list[str] | None = None
    activation_memory_budget_mb: float | None = None

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rank_key(c: Choice) -> tuple[bool, bool, bool, float, float]:
    """The table's order: configurations that fit first, simulated before estimated (and
    refused ones last), by step time, and at equal time the smaller footprint (where ZeRO-1
    and ZeRO-2 run the same step, its gradients held whole or sharded, the one a user would
    choose)."""
    return (not c.fits, c.how != "simulated", c.how.startswith("refused"), c.step_time_s,
            c.memory_per_device_gb)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def load_model(model_spec: str, seq: int | None) -> tuple[Callable[[int], Any], int | None]:
    """rows -> the model captured with that batch (shapes only for presets); its heads."""
    from ..proxies.models import MODELS

    if model_spec in MODELS:
        builder: Any = MODELS[model_spec][0]
        kw: dict[str, Any] = dict(MODELS[model_spec][1], seq=seq or 2048)
        return (lambda rows: builder(**kw, batch=rows)), kw.get("heads")
    if ":" not in model_spec:
        raise SystemExit(f"unknown model {model_spec!r}: a preset ({', '.join(MODELS)}) or "
                         "script.py:fn")
    from .explain_plan import capture

    base = capture(model_spec).without_values()
    return base.at_batch, None


def _forward_bytes(func: Any) -> tuple[int, int]:
    """(bytes of every tensor the forward computes from the data, bytes of its matmul
    outputs)."""
    from tvm import relax

    from ..proxies.extract import type_nbytes

    every = matmul = 0
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call):
                n = type_nbytes(b.var.ty)
                every += n
                if getattr(b.value.op, "name", "") == "relax.matmul":
                    matmul += n
    return every, matmul


def stage_info(piece: Any, pp: int) -> list[tuple[Any, ...]]:
    """Per stage of ``piece`` cut in ``pp``: (parameter names, forward bytes, matmul output
    bytes, input bytes, blocks); the pipeline's own stage plan (one stage when pp = 1)."""
    from ..passes.stage_split import split_forward
    from ..proxies.extract import type_nbytes
    from ..training.pipeline_step import stage_plan

    plan = stage_plan(piece, pp, 1)
    funcs = split_forward(plan)
    points = plan.graph.cut_points()
    out = []
    for s, f in enumerate(funcs):
        lo, hi = plan.bounds(s)
        inside = [p for p in points if lo < p.position < hi]
        blocks = 1 + len(inside)  # the step's recomputation goes block by block
        cuts = sum(type_nbytes(p.var.ty) for p in inside)  # the block inputs it keeps
        inp = 0 if s == 0 else type_nbytes(f.function.params[0].ty)
        every, matmul = _forward_bytes(f.function)
        out.append((list(plan.params[s]), every, matmul, inp, blocks, cuts))
    return out


def activation_bytes(every: int, matmul: int, inp: int, blocks: int, cuts: int,
                     recompute: str, pipelined: bool, in_flight: int) -> float:
    """A stage's activations at their peak: the values kept for each microbatch in flight
    plus what one backward recomputes. Without pipelining the step recomputes block by block
    (passes/remat.py: "full" keeps every block's input and the last block's values,
    "selective" the matmul outputs and the block inputs); a pipeline stage checkpoints as a
    whole under "full" (it keeps its input and runs its forward again inside B) and keeps its
    matmul outputs and input under "selective" (B recomputes the cheap rest)."""
    if recompute == "none":
        return in_flight * every
    if pipelined and recompute == "full":  # the stage input only, the whole forward again
        return in_flight * inp + every
    if pipelined:  # "selective"
        return in_flight * (matmul + inp) + (every - matmul)
    if recompute == "full":
        return in_flight * (cuts + every / blocks) + every / blocks
    return in_flight * (matmul + cuts) + (every - matmul) / blocks


def boundary_bytes(stages: Sequence[tuple[Any, ...]], owners: Sequence[int], rank: int,
                   microbatches: int, pp: int) -> float:
    """The stage-boundary messages pp rank ``rank`` holds at most through a 1F1B step (as
    runtime/stage_budget.held_timeline walks the Trainer's: every receive posted at the
    step's start, every sent message kept to its end). Across the boundary below stage s
    the rank holds M - k messages (forward receives not yet read, input gradients sent),
    across the one above it M + k (activations sent, gradient receives not yet read), where
    k = forwards - backwards run so far, 0 .. min(P - rank, M); the larger end counts.
    ``stages``: stage_info's rows (their input bytes: the boundary before them)."""
    held = 0.0
    last = len(stages) - 1
    ahead = min(pp - rank, microbatches)
    for s, o in enumerate(owners):
        if o != rank:
            continue
        below = stages[s][3] if s > 0 else 0
        above = stages[s + 1][3] if s < last else 0
        held += max(microbatches * (below + above),
                    (microbatches - ahead) * below + (microbatches + ahead) * above)
    return held


def _model_states(piece: Any, mesh: Any, stages: Sequence[tuple[Any, ...]],
                  owners: Sequence[int], rank: int) -> int:
    """Parameters, gradients and AdamW's state pp rank ``rank`` holds (raf_dist.layout)."""
    from .estimate_memory import model_state_bytes

    specs = dict(zip(piece.param_names, piece.param_specs()))
    names = [n for (ns, *_), o in zip(stages, owners) if o == rank for n in ns]
    numels = [int(np.prod(specs[n][0])) for n in names]
    states = model_state_bytes(numels, mesh.dp, mesh.zero, STATES_PER_PARAM)
    return states["param_bytes"] + states["grad_bytes"] + states["optimizer_state_bytes"]


def _activations(mesh: Any, precision: str, stages: Sequence[tuple[Any, ...]],
                 owners: Sequence[int], rank: int, levels: Sequence[str]) -> float:
    """The activations and boundary messages pp rank ``rank`` holds at its peak, its stages
    recomputing at ``levels`` (one per stage)."""
    act = 0.0
    for (_, every, matmul, inp, blocks, cuts), o, level in zip(stages, owners, levels):
        if o != rank:
            continue
        in_flight = min(mesh.pp - rank, mesh.microbatches) if mesh.pp > 1 else 1
        act += activation_bytes(every, matmul, inp, blocks, cuts, level, mesh.pp > 1,
                                in_flight)
    if mesh.pp > 1:
        act += boundary_bytes(stages, owners, rank, mesh.microbatches, mesh.pp)
    return act * (0.5 if precision == "16-bit" else 1.0)


def memory_bytes(piece: Any, mesh: Any, precision: str,
                 stages: list[tuple[Any, ...]] | None = None,
                 levels: Sequence[str] | None = None) -> float:
    """Per device, the most any pp rank holds (module docstring); ``stages``: stage_info;
    ``levels``: each stage's recomputation (default ``mesh.recompute`` for all)."""
    from ..layout import stage_rank

    stages = stages if stages is not None else stage_info(piece, mesh.pp)
    owners = [stage_rank(s, mesh.pp) for s in range(len(stages))]
    levels = list(levels) if levels is not None else [mesh.recompute] * len(stages)
    return max(_model_states(piece, mesh, stages, owners, r)
               + _activations(mesh, precision, stages, owners, r, levels)
               for r in range(mesh.pp))


def stage_levels(piece: Any, mesh: Any, precision: str, stages: list[tuple[Any, ...]],
                 limit_bytes: float) -> tuple[list[str], float | None]:
    """What ``activation_memory_budget_mb`` makes the Trainer choose under pipelining, on
    this model of the memory: each pp rank raises one of its stages one level at a time
    (none -> selective -> full), the raise that lowers the rank's peak most first (ties: the
    earlier stage), until its states and activations fit ``limit_bytes``
    (runtime/stage_budget.choose, on the Trainer's own model). Returns the levels and the
    budget to set in MB (the device memory less the largest rank's model states: the one
    value every rank is given), or None when some rank does not fit even at "full"."""
    from ..layout import stage_rank
    from ..runtime.stage_budget import LEVELS, raise_levels

    names = [str(level) if level else "none" for level in LEVELS]  # False is "none" here
    owners = [stage_rank(s, mesh.pp) for s in range(len(stages))]
    levels = ["none"] * len(stages)
    states = [_model_states(piece, mesh, stages, owners, r) for r in range(mesh.pp)]
    for r in range(mesh.pp):
        def peak(trial: dict[int, int], r: int = r) -> float:
            named = list(levels)
            for s, i in trial.items():
                named[s] = names[i]
            return states[r] + _activations(mesh, precision, stages, owners, r, named)

        chosen, _ = raise_levels([s for s, o in enumerate(owners) if o == r], peak,
                                 limit_bytes)
        if chosen is None:
            return levels, None
        for s, i in chosen.items():
            levels[s] = names[i]
    return levels, (limit_bytes - max(states)) / 2**20


def candidates(devices: int, gpus_per_node: int, heads: int | None, global_batch: int,
               layers_hint: int) -> list[Any]:
    """Every MeshSpec the Trainer accepts on ``devices`` (module docstring)."""
    from ..proxies.extract import MeshSpec

    out = []
    for tp in _divisors(devices):
        if tp > gpus_per_node or (heads and heads % tp):
            continue
        for pp in _divisors(devices // tp):
            if pp > max(1, layers_hint):
                continue
            dp = devices // (tp * pp)
            if global_batch % dp:
                continue
            per_dp = global_batch // dp
            micro = ([m for m in sorted({pp, 2 * pp, 4 * pp, 8 * pp, per_dp}) if per_dp % m == 0]
                     if pp > 1 else [m for m in (1, 2, 4) if per_dp % m == 0])
            for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                for m in micro:
                    for rec in ("none", "selective", "full"):
                        try:
                            out.append(MeshSpec(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=m,
                                                recompute=rec))
                        except ValueError:
                            continue  # a combination the Trainer refuses
    return out


def plan(model_spec: str, devices: int, device_memory_gb: float, global_batch: int,
         seq: int | None = None, cluster_spec: str = "dgx-a100", precision: str = "fp32",
         budget_s: float = 120.0, log: Callable[[str], None] | None = None,
         max_simulations: int | None = None) -> list[Choice]:
    """The ranked configurations (module docstring); at most ``max_simulations`` simulated
    (None: as many as ``budget_s`` allows)."""
    from ..ir.utils import op_name
    from ..proxies import extract, load_cluster, simulate
    from ..runtime.metrics import function_flops
    from ..training import tensor_parallel as tp_lib

    cluster = load_cluster(cluster_spec)
    at_rows, heads = load_model(model_spec, seq)
    whole = at_rows(global_batch)
    train_flops = 3 * function_flops(whole.forward)
    train_bytes = 3 * _forward_bytes(whole.forward)[0]  # what the other operators move
    # operator calls of a step, as the extraction counts them: the forward and ~2x in the
    # backward per microbatch (a stage's share on each rank, whatever its dp or tp), and the
    # update once per step, ~10 elementwise calls per parameter tensor (AdamW's moments,
    # bias corrections and the write)
    train_ops = 3 * sum(1 for block in whole.forward.body.blocks for b in block.bindings
                        if op_name(b.value))
    update_ops = 10 * len(whole.param_names)
    n_params = sum(int(np.prod(s)) for s, _ in whole.param_specs())
    # a pipeline stage per single-tensor cut at most (the partitioner's candidates)
    from ..training.pipeline_step import stage_plan

    layers = len(stage_plan(whole, 1, 1).graph.cut_points()) + 1
    choices, pieces, infos = [], {}, {}

    def estimate(c: Choice, mesh: Any, levels: Sequence[str]) -> None:
        """The quick estimate (module docstring); the slowest stage's recomputation bounds a
        pipeline's time. Every matmul at ``matmul_tflops``: a calibrated cluster's measured
        shapes (``Cluster.gemm_efficiency``) count in the simulation that follows."""
        extra = max({"none": 0.0, "selective": 0.3, "full": 1.0}[lv] for lv in levels)
        compute = (train_flops / (cluster.matmul_tflops * 1e12)
                   + train_bytes / (cluster.memory_GBps * 1e9)) * (1 + extra / 3) / devices
        bubble = (mesh.pp - 1) / mesh.microbatches if mesh.pp > 1 else 0.0
        grads = 4 * n_params / (mesh.tp * mesh.pp)
        link = cluster.intra if mesh.tp * mesh.dp <= cluster.gpus_per_node else cluster.inter
        reduce = (2 * (mesh.dp - 1) / mesh.dp * grads / (link.bandwidth_GBps * 1e9)
                  * (1.5 if mesh.zero == 3 else 1.0))
        host = ((train_ops * mesh.microbatches + update_ops) / mesh.pp
                * cluster.op_overhead_us * 1e-6)
        c.step_time_s = (compute + host) * (1 + bubble) + reduce
        c.comm_bytes_per_step = int(2 * grads * (mesh.dp - 1) / mesh.dp)
        c.how = "estimated"

    for mesh in candidates(devices, cluster.gpus_per_node, heads, global_batch, layers):
        rows = global_batch // (mesh.dp * mesh.microbatches)
        c = Choice(mesh.dp, mesh.tp, mesh.pp, mesh.zero, mesh.microbatches, mesh.recompute)
        key = (rows, mesh.tp)
        try:
            if key not in pieces:
                piece = at_rows(rows).without_values()
                if mesh.tp > 1:
                    tplan = tp_lib.make_plan(piece, mesh.tp)
                    piece = tp_lib.shard_model(piece, tplan, 0, piece.init_params, values=False)
                pieces[key] = piece
            if (key, mesh.pp) not in infos:
                infos[(key, mesh.pp)] = stage_info(pieces[key], mesh.pp)
            c.memory_per_device_gb = memory_bytes(pieces[key], mesh, precision,
                                                  infos[(key, mesh.pp)]) / 2**30
        except (ValueError, NotImplementedError) as e:  # no tp plan / pipeline cut for it
            c.how = f"refused: {str(e)[:60]}"
            choices.append((c, mesh))
            continue
        c.fits = c.memory_per_device_gb <= device_memory_gb
        estimate(c, mesh, [mesh.recompute])
        choices.append((c, mesh))
        if mesh.pp > 1 and mesh.recompute == "none" and not c.fits:
            # activation_memory_budget_mb: each stage recomputes only as much as its rank
            # needs to fit (a later stage holds fewer microbatches in flight)
            levels, budget_mb = stage_levels(pieces[key], mesh, precision,
                                             infos[(key, mesh.pp)], device_memory_gb * 2**30)
            if budget_mb is not None and len(set(levels)) > 1:  # else a uniform row's twin
                b = dataclasses.replace(c, recompute="budget", stage_recompute=levels,
                                        activation_memory_budget_mb=round(budget_mb, 1))
                b.memory_per_device_gb = memory_bytes(pieces[key], mesh, precision,
                                                      infos[(key, mesh.pp)], levels) / 2**30
                b.fits = b.memory_per_device_gb <= device_memory_gb
                estimate(b, mesh, levels)
                choices.append((b, dataclasses.replace(mesh, stage_recompute=tuple(levels))))
    # simulated in estimate order, but each mesh shape's best first: the estimate leaves out
    # the tp collectives and the overlap, so every (dp, tp, pp) gets a simulated row early
    fitting = sorted([x for x in choices if x[0].fits], key=lambda x: x[0].step_time_s)
    shapes: dict[tuple[int, int, int], int] = {}
    for c, _ in fitting:
        shapes.setdefault((c.dp, c.tp, c.pp), len(shapes))
    rank_in_shape: dict[tuple[int, int, int], int] = {}
    order = []
    for c, mesh in fitting:
        k = (c.dp, c.tp, c.pp)
        rank_in_shape[k] = rank_in_shape.get(k, -1) + 1
        order.append((rank_in_shape[k], shapes[k], c, mesh))
    fitting = [(c, mesh) for _, _, c, mesh in sorted(order, key=lambda x: x[:2])]
    started = time.perf_counter()
    for done, (c, mesh) in enumerate(fitting):
        if time.perf_counter() - started > budget_s or (max_simulations is not None
                                                        and done >= max_simulations):
            break
        rows = global_batch // mesh.dp
        try:
            workload = extract(at_rows(rows), mesh, name=model_spec)
        except (ValueError, NotImplementedError) as e:
            c.how = f"not extracted: {str(e)[:50]}"
            continue
        if precision == "16-bit":
            workload = workload.in_16_bit()
        result = simulate(workload, cluster)
        c.step_time_s = result.iteration_s
        c.comm_bytes_per_step = int(max(  # bus bytes, as the estimate's and the counters'
            sum(v["bus_bytes"] for kinds in workload.bus_bytes(r).values()
                for v in kinds.values())
            + sum(e.bytes for e in workload.programs[r] if e.kind == "send")
            for r in range(workload.pp)))
        c.how = "simulated"
        if log:
            log(f"simulated dp{mesh.dp} tp{mesh.tp} pp{mesh.pp} zero{mesh.zero} "
                f"M{mesh.microbatches} {_recompute_label(c)}: {c.step_time_s:.4g} s")
    ranked = [c for c, _ in choices]
    ranked.sort(key=rank_key)
    return ranked


def _recompute_label(c: Choice) -> str:
    """The recompute column: the policy, or a budget's levels per stage and its value."""
    if not c.stage_recompute:
        return c.recompute
    short = {"none": "n", "selective": "s", "full": "f"}
    return (f"budget {c.activation_memory_budget_mb:g} MB "
            f"({','.join(short[lv] for lv in c.stage_recompute)})")


def table(choices: Sequence[Choice], top: int) -> str:
    head = ["#", "dp", "tp", "pp", "zero", "M", "recompute", "step s", "mem GB/dev", "fits",
            "comm GB/step", "how"]
    lines = [head]
    for i, c in enumerate(choices[:top]):
        lines.append([str(i + 1), str(c.dp), str(c.tp), str(c.pp), str(c.zero),
                      str(c.microbatches), _recompute_label(c), f"{c.step_time_s:.4g}",
                      f"{c.memory_per_device_gb:.2f}", "yes" if c.fits else "NO",
                      f"{c.comm_bytes_per_step / 2**30:.2f}", c.how])
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m raf_dist.tools.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--device-memory-gb", type=float, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--seq", type=int, help="sequence length of the presets (2048)")
    p.add_argument("--cluster", default="dgx-a100")
    p.add_argument("--precision", default="fp32", choices=("fp32", "16-bit"))
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="seconds of extraction + simulation; the rest keep their estimate")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.devices < 1 or a.global_batch < 1 or a.device_memory_gb <= 0:
        raise SystemExit("--devices, --global-batch and --device-memory-gb must be positive")
    ranked = plan(a.model, a.devices, a.device_memory_gb, a.global_batch, a.seq, a.cluster,
                  a.precision, a.budget_s, log=None if a.json else
                  (lambda s: print(s, file=sys.stderr)))
    if a.json:
        print(json.dumps([c.row() for c in ranked]))
    else:
        if not any(c.fits for c in ranked):
            print(f"no configuration fits {a.device_memory_gb:g} GB per device; the smallest "
                  "needs " + (f"{min(c.memory_per_device_gb for c in ranked):.2f} GB"
                              if ranked else "(none could be built)"))
        print(table(ranked, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
