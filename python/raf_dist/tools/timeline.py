"""Merge the ranks' Chrome traces of a profiled run and show where the time went.

    python -m raf_dist.tools.timeline DIR -o timeline.png [--top 10] [--skip N] [--merged all.json]

DIR holds ``trace-rank{R}.json`` files (``Trainer.profile(steps, DIR)`` or
``RAF_DIST_PROFILE=DIR``). Prints, per rank, the time in steps, compute (kernels, BLAS, the
VM's builtins) and communication (collective calls, waits included), then the calls that
took the most time in all; draws compute vs communication per rank over time (matplotlib,
one lane each, steps as a band behind them); ``--merged`` writes one trace with every rank
for Perfetto / chrome://tracing; ``--skip N`` leaves out each rank's first N recorded steps
(warm-up: first-touch allocations, thread pools starting). Times are aligned on the ranks'
wall clocks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence


COMPUTE = ("kernel", "blas", "vm")
_COLOURS = {"kernel": "tab:blue", "blas": "tab:green", "vm": "tab:gray",
            "collective": "tab:red", "step": "0.92"}

#: one Trace Event Format event (a JSON object)
Event = dict[str, Any]
#: {rank: [complete events]}
Traces = dict[int, list[Event]]


def load_traces(directory: str | os.PathLike[str]) -> Traces:
    """{rank: [complete events]} of every ``trace-rank{R}.json`` in ``directory``."""
    directory = Path(directory)
    files = sorted(directory.glob("trace-rank*.json"))
    if not files:
        raise FileNotFoundError(
            f"no trace-rank*.json in {directory}: profile a run first with "
            "trainer.profile(steps, path) or RAF_DIST_PROFILE=path")
    traces: Traces = {}
    for path in files:
        events = json.loads(path.read_text())["traceEvents"]
        complete = [e for e in events if e.get("ph") == "X"]
        rank = path.stem[len("trace-rank"):]
        if not rank.isdigit():
            raise ValueError(f"{path}: expected trace-rank<integer>.json, as Trainer.profile "
                             "writes; move other files out of the directory")
        traces[int(rank)] = complete
    return traces


def skip_steps(traces: Traces, count: int) -> Traces:
    """``traces`` without each rank's first ``count`` steps (and every event before the end
    of the last one skipped)."""
    if count <= 0:
        return traces
    out = {}
    for rank, events in traces.items():
        steps = sorted((e for e in events if e["cat"] == "step"), key=lambda e: e["ts"])
        if len(steps) <= count:
            raise ValueError(f"rank {rank} recorded {len(steps)} steps: cannot skip {count}; "
                             "profile more steps or skip fewer")
        cutoff = steps[count - 1]["ts"] + steps[count - 1]["dur"]
        out[rank] = [e for e in events if e["ts"] >= cutoff]
    return out


def summary(traces: Traces) -> dict[int, dict[str, float]]:
    """Per rank: milliseconds in steps, compute and communication, and the step count."""
    out = {}
    for rank, events in traces.items():
        ms: defaultdict[str, float] = defaultdict(float)
        for e in events:
            ms[e["cat"]] += e["dur"] / 1000.0
        out[rank] = {"steps": sum(1 for e in events if e["cat"] == "step"),
                     "step_ms": ms["step"], "compute_ms": sum(ms[c] for c in COMPUTE),
                     "communication_ms": ms["collective"]}
    return out


def top_calls(traces: Traces, top: int = 10) -> list[dict[str, Any]]:
    """The ``top`` callees by total time over every rank and step: dicts with name,
    category, calls, total_ms, mean_us and share (of all step time)."""
    # name -> [calls, total us, category]
    totals: defaultdict[str, list[Any]] = defaultdict(lambda: [0, 0.0, ""])
    step_us = 0.0
    for events in traces.values():
        for e in events:
            if e["cat"] == "step":
                step_us += e["dur"]
                continue
            entry = totals[e["name"]]
            entry[0] += 1
            entry[1] += e["dur"]
            entry[2] = e["cat"]
    rows = [{"name": name, "category": cat, "calls": calls, "total_ms": us / 1000.0,
             "mean_us": us / calls, "share": us / step_us if step_us else 0.0}
            for name, (calls, us, cat) in totals.items()]
    rows.sort(key=lambda row: -row["total_ms"])
    return rows[:top]


def merge(traces: Traces) -> dict[str, Any]:
    """One Trace Event Format document with every rank (its pid is the rank)."""
    events = []
    for rank in sorted(traces):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.extend(traces[rank])
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(traces: Traces, output: str | os.PathLike[str]) -> None:
    """Compute vs communication per rank over time, written to ``output`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(e["ts"] for events in traces.values() for e in events)
    ranks = sorted(traces)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.9 * len(ranks)))
    lanes = {"compute": 0.0, "collective": 0.4}  # offsets inside a rank's row
    for row, rank in enumerate(ranks):
        base = row * 1.0
        bars: defaultdict[str, list[tuple[float, float]]] = defaultdict(list)
        for e in traces[rank]:
            bars[e["cat"]].append(((e["ts"] - origin) / 1000.0, e["dur"] / 1000.0))
        ax.broken_barh(bars.pop("step", []), (base - 0.05, 0.85), facecolors=_COLOURS["step"],
                       edgecolors="0.6", linewidth=0.5)
        for cat, spans in bars.items():
            lane = lanes["collective" if cat == "collective" else "compute"]
            ax.broken_barh(spans, (base + lane, 0.35),
                           facecolors=_COLOURS.get(cat, "tab:purple"), linewidth=0)
    ax.set_yticks([row + 0.375 for row in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlabel("time (ms)")
    ax.set_title("per rank: compute (upper lane), communication (lower lane), steps behind")
    ax.legend(handles=[Patch(color=_COLOURS[c], label=c) for c in
                       ("kernel", "blas", "vm", "collective", "step")],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 / len(ranks) - 0.1),
              fontsize="small", ncol=5, frameon=False)
    ax.invert_yaxis()
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120, bbox_inches="tight")
    plt.close(fig)


def report(traces: Traces, top: int = 10) -> str:
    lines = []
    for rank, s in sorted(summary(traces).items()):
        other = s["step_ms"] - s["compute_ms"] - s["communication_ms"]
        lines.append(f"rank {rank}: {s['steps']} steps, {s['step_ms']:.1f} ms in steps: compute "
                     f"{s['compute_ms']:.1f} ms, communication {s['communication_ms']:.1f} ms, "
                     f"between calls {other:.1f} ms (Python, VM dispatch, the profiler)")
    lines.append(f"{'calls':>6} {'total ms':>9} {'mean us':>9} {'share':>6}  category    name")
    for r in top_calls(traces, top):
        lines.append(f"{r['calls']:>6} {r['total_ms']:>9.2f} {r['mean_us']:>9.1f} "
                     f"{r['share']:>6.1%}  {r['category']:<11} {r['name']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="directory of trace-rank{R}.json files")
    parser.add_argument("-o", "--output", default="timeline.png", help="PNG to write")
    parser.add_argument("--top", type=int, default=10, help="callees to list (by total time)")
    parser.add_argument("--skip", type=int, default=0,
                        help="leave out each rank's first SKIP recorded steps (warm-up)")
    parser.add_argument("--merged", help="also write every rank's events to this JSON trace")
    args = parser.parse_args(argv)
    traces = skip_steps(load_traces(args.directory), args.skip)
    print(report(traces, args.top))
    plot(traces, args.output)
    print(f"wrote {args.output}")
    if args.merged:
        Path(args.merged).write_text(json.dumps(merge(traces)))
        print(f"wrote {args.merged}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
