"""What pipeline parallelism would do to a model, in one process (no MPI, no Trainer).

    text = raf_dist.tools.explain_pipeline.explain_pipeline(model, pp=2, microbatches=4)

    python -m raf_dist.tools.explain_pipeline --pp P [--stages-per-rank V] [--microbatches M]
        [--schedule gpipe|1f1b|interleaved_1f1b] [--split-points a,b] [--png schedule.png]
        MODEL_SPEC

``MODEL_SPEC`` is ``module.path:factory`` or ``path/to/file.py:factory`` (as for
``raf_dist.tools.explain_plan``); ``factory()`` returns ``(torch_module, example_input[,
target])``. The model is captured with ``raf_dist.frontend.from_pytorch`` and cut into
``S = P * V`` stages as the pipeline Trainer cuts it (passes/stage_partition.py: at the
model's stage markers, before the modules named by ``--split-points``, or by the cost
partitioner), at the microbatch's rows (the captured batch / M). ``V`` is 1 for ``gpipe`` and
``1f1b``; ``interleaved_1f1b`` takes ``--stages-per-rank`` (default 2, as
``pipeline_stages_per_rank``) and needs M a multiple of P. Printed:

- the stage plan (``StagePlan.describe()``: bindings, parameters and cost of each stage);
- each pp rank's action list (``training/pipeline_schedule.rank_actions``: F/B with the
  SEND/RECV around them and the final UPDATE);
- the simulated bubble against the textbook ``(P-1) / (M*V + P-1)``;
- the peak number of microbatches in flight (forward run, backward not yet) per stage, i.e.
  how many microbatches of activations each stage holds at once;
- with ``--png``: the simulated schedule drawn (``pipeline_schedule.draw``).

The simulation uses uniform costs, forward 1 and backward 2 for every stage
(``pipeline_simulation.simulate`` takes one forward and one backward cost for all actions, not
one per stage), so its bubble is the schedule's own; the stage plan's cost column shows how
far the real stages are from that balance (the slowest stage sets the pace).

For example, the 4-layer GPT of the benchmarks on 2 pipeline ranks with 4 microbatches:

    python -m raf_dist.tools.explain_pipeline --pp 2 --microbatches 4 --png /tmp/s.png \\
        bench/step_time.py:gpt
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Sequence

from .explain_plan import capture, model_parser

if TYPE_CHECKING:
    from ..model import Model
    from ..passes.stage_partition import StagePlan
    from ..training.pipeline_schedule import Action

    #: ``pipeline_simulation.simulate``'s entries: (rank, kind, stage, microbatch, start, end)
    TimelineEntry = tuple[int, str, int, int, float, float]

#: simulated cost of one stage's forward and backward of one microbatch (uniform: the
#: simulator takes one cost per kind)
FORWARD_COST = 1.0
BACKWARD_COST = 2.0


def simulate_pipeline(pp: int, microbatches: int = 1, schedule: str = "1f1b",
                      stages_per_rank: int = 1) -> tuple[list[list[Action]], list[TimelineEntry]]:
    """(actions, timeline) of the schedule: ``rank_actions`` and its ``simulate`` with
    uniform costs (F = 1, B = 2)."""
    from ..training import pipeline_schedule as ps
    from ..training import pipeline_simulation as sim

    actions = ps.rank_actions(schedule, pp, microbatches, stages_per_rank)
    ps.check_actions(actions, ps.num_stages(schedule, pp, stages_per_rank), microbatches)
    timeline = sim.simulate(actions, FORWARD_COST, BACKWARD_COST)
    return actions, timeline


def explain_pipeline(model: Model, pp: int, microbatches: int = 1, schedule: str = "1f1b",
                     stages_per_rank: int = 1, split_points: Sequence[str] | None = None,
                     png: str | os.PathLike[str] | None = None) -> str:
    """The pipeline plan of ``model`` as text (module docstring): stage plan, each rank's
    actions, simulated vs ideal bubble, peak in-flight microbatches per stage. ``png``: also
    draw the simulated schedule there. Pure: one process, no MPI.

    ``model``: a captured :class:`raf_dist.Model`. ``stages_per_rank``: 1 unless
    ``schedule="interleaved_1f1b"`` (then >= 2). ``split_points``: module names before which
    stages 1 .. S-1 start (as ``pipeline_split_points``), else the partitioner decides.
    """
    from ..model import Model
    from ..training import pipeline_schedule as ps
    from ..training import pipeline_simulation as sim

    if not isinstance(model, Model):
        raise TypeError(f"explain_pipeline takes a captured raf_dist Model (from "
                        f"raf_dist.frontend.from_pytorch or from_relax_nn), got "
                        f"{type(model).__name__}")
    for name, value in (("pp", pp), ("microbatches", microbatches),
                        ("stages_per_rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    num_stages = ps.num_stages(schedule, pp, stages_per_rank)  # validates the combination
    from ..training.pipeline_step import stage_plan

    plan = stage_plan(model, num_stages, microbatches, split_points, ranks=pp)
    actions, timeline = simulate_pipeline(pp, microbatches, schedule, stages_per_rank)

    lines = [plan.describe(), ""]
    lines.append(f"schedule {schedule}: P={pp} ranks, S={num_stages} stages "
                 f"({stages_per_rank} per rank, stage s on rank s % P), M={microbatches} "
                 "microbatches")
    for r in range(pp):
        lines.append(f"  rank {r}: " + " ".join(str(a) for a in actions[r]))
    bubble = sim.bubble_fraction(timeline)
    ideal = sim.ideal_bubble(pp, microbatches, stages_per_rank)
    makespan = max(e[5] for e in timeline) - min(e[4] for e in timeline)
    work = microbatches * stages_per_rank * (FORWARD_COST + BACKWARD_COST)
    lines.append("")
    lines.append(f"simulated bubble (uniform costs F={FORWARD_COST:g}, B={BACKWARD_COST:g}): "
                 f"{bubble:.1%}, ideal (P-1)/(M*V+P-1) = {ideal:.1%}; makespan "
                 f"{makespan:g} vs {work:g} of work per rank")
    total = sum(plan.costs) or 1.0
    share = max(plan.costs) / total
    lines.append(f"stage cost balance: the largest stage holds {share:.0%} of the cost "
                 f"(even: {1 / num_stages:.0%}); the simulation assumes even stages, uneven "
                 "ones add to the real bubble")
    peaks = sim.peak_in_flight(actions, num_stages)
    lines.append("peak microbatches in flight (activations held) per stage: "
                 + ", ".join(f"stage {s}: {peaks[s]}" for s in range(num_stages)))
    if png:
        title = f"{schedule} P={pp} M={microbatches}" + (
            f" v={stages_per_rank}" if stages_per_rank > 1 else "")
        lines.append(f"schedule drawn to {sim.draw(timeline, png, title)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from ..training.pipeline_schedule import SCHEDULES

    parser = model_parser("explain_pipeline", "Print the pipeline stages and schedule of a model")
    parser.add_argument("--pp", type=int, required=True, help="pipeline_parallel_size P")
    parser.add_argument("--stages-per-rank", type=int, default=None,
                        help="stages per rank V (interleaved_1f1b only; default 2 there, "
                             "1 otherwise)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="num_microbatches M (default: %(default)s)")
    parser.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES),
                        help="pipeline_schedule (default: %(default)s)")
    parser.add_argument("--split-points", default=None,
                        help="comma-separated module names where stages 1..S-1 start "
                             "(pipeline_split_points); default: the partitioner decides")
    parser.add_argument("--png", default=None, help="draw the simulated schedule to this PNG")
    args = parser.parse_args(argv)
    v = args.stages_per_rank
    if v is None:
        v = 2 if args.schedule == "interleaved_1f1b" else 1
    split = [s for s in args.split_points.split(",") if s] if args.split_points else None
    try:
        text = explain_pipeline(capture(args.model), args.pp, args.microbatches, args.schedule,
                                v, split, png=args.png)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"explain_pipeline: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
