"""Memory per rank of a training step at each ZeRO level, before launching anything.

    raf_dist.estimate_memory(model, optimizer, world_size, zero_opt_level)
    python -m raf_dist.tools.estimate_memory --params 1.5e9 --world-sizes 8,64
    python -m raf_dist.tools.estimate_memory --script my_model.py --optimizer adamw

Model states follow DESIGN.md section 3 exactly (flat, padded shards of ceil(n/N) elements
per tensor): parameters 4Ψ, or 4Ψ/N at level 3; optimizer state K·4Ψ, or K·4Ψ/N from level 1;
gradients that outlive their bucket 4Ψ at levels 0–1, 4Ψ/N at 2–3 (fp32 sizes shown; the
parameters' own dtype is used). With a model, the step's planned temporaries (activations,
gradient buckets, in-flight collective buffers; not the new parameters and optimizer state,
which the step writes into the buffers it was given) come from building the
step for that world size and level and running TVM's memory planner on it, without MPI and
without compiling code: the same figure ``Trainer.stats()["planned_peak_bytes"]`` reports for
the run. Capture the model with the per-rank batch, as the run would.
Peak = parameters + optimizer state + planned temporaries, as in the ZeRO accounting;
``process_bytes`` adds what loading TVM, torch.export and MPI added to this process (measured
as they loaded: raf_dist.process_memory; the compiler's code aside, which a run drops after
construction), what the step's host kernels keep for themselves (BLAS packing buffers, the
thread pool: ``runtime_bytes``) and what their transients leave in the C allocator's free heap
(the convolutions' im2col copies: ``allocator_free_bytes``): the RSS growth a run would show
(``+libraries``). Those two are measured, not modelled: the step's BLAS and convolution calls
run twice at the step's shapes on zero operands, in a child process with the threads a rank
of the run gets (``ranks_per_host`` ranks on its host; default ``world_size``), which the
caller's process does not keep (runtime/host_kernels.py). That child briefly holds the
largest call's output and takes a few kernel runs' time (2-6 s on the tests' models).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import TYPE_CHECKING, Mapping, Sequence

from .. import process_memory
from ..layout import state_layout

if TYPE_CHECKING:
    from ..model import Model
    from ..optim import Optimizer

_STATES_PER_PARAM = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


def model_state_bytes(numels: Sequence[int], world_size: int, zero_opt_level: int,
                      states_per_param: int, elem_bytes: int = 4) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds, from the tensor sizes (the
    StateLayout the Trainer holds them under: raf_dist.layout)."""
    layout = state_layout([f"p{i}" for i in range(len(numels))],
                          [((int(n),), f"float{8 * int(elem_bytes)}") for n in numels],
                          [f"state{j}" for j in range(int(states_per_param))],
                          zero_opt_level, int(world_size), 0, [tuple(range(len(numels)))])
    return {"param_bytes": layout.param_bytes(), "grad_bytes": layout.grad_bytes(),
            "optimizer_state_bytes": layout.state_bytes()}


def estimate_memory(model: Model, optimizer: Optimizer, world_size: int, zero_opt_level: int,
                    bucket_size_mb: float = 25.0, loss: str = "cross_entropy",
                    overlap_comm: bool = True,
                    ranks_per_host: int | None = None, context_parallel_size: int = 1,
                    context_parallel_method: str = "ring") -> dict[str, int]:
    """Bytes per rank for ``model`` (a captured :class:`raf_dist.Model`) trained with
    ``optimizer`` on ``world_size`` ranks at ``zero_opt_level``: the model states plus
    ``planned_peak_bytes`` from TVM's memory planner and their sum ``peak_bytes``; with
    ``process_bytes`` the RSS growth a run would show (module docstring), its host kernels
    measured with the threads of ``ranks_per_host`` ranks on a host (default
    ``world_size``). ``context_parallel_size``: each sequence split over that many of the
    ``world_size`` ranks (gradients and ZeRO's shards over all of them, the activations of a
    rank's tokens only: passes/context_parallel.py); ``model`` captured with whole
    sequences, as the run's Trainer is given them."""
    from ..compiler import planned_bytes
    from ..compiler.build import planned_module
    from ..distributed.communicator import load_mpi
    from ..distributed.config import DistConfig
    from ..optim import Optimizer
    from ..runtime.plan import plan_run
    from ..runtime.spmd_build import plan_step

    if zero_opt_level not in (0, 1, 2, 3):
        raise ValueError(f"zero_opt_level must be 0, 1, 2 or 3, got {zero_opt_level!r}")
    if int(world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if ranks_per_host is not None and (isinstance(ranks_per_host, bool)
                                       or not isinstance(ranks_per_host, int)
                                       or ranks_per_host < 1):
        raise ValueError(f"ranks_per_host must be an int >= 1 (the run's ranks on each host; "
                         f"default: world_size), got {ranks_per_host!r}")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a raf_dist.optim optimizer, got {optimizer!r}")
    # the step rank 0's Trainer builds (runtime/spmd_build.py: the same builder, with no
    # communicator and nothing compiled), with its default non-finite check and, on several
    # ranks, the loss weight of uneven batches (training/batch_size.py)
    dp = int(world_size) // max(1, int(context_parallel_size))
    config = DistConfig(enable_data_parallel=dp > 1 or zero_opt_level > 0,
                        zero_opt_level=zero_opt_level, bucket_size_mb=bucket_size_mb,
                        overlap_comm=overlap_comm, context_parallel_size=context_parallel_size,
                        context_parallel_method=context_parallel_method)
    planned = plan_step(model, loss, optimizer, plan_run(config, int(world_size), 0,
                                                         model=model, optimizer=optimizer))
    held = planned.layout  # the StateLayout the Trainer holds its states under
    out = {"param_bytes": held.param_bytes(), "grad_bytes": held.grad_bytes(),
           "optimizer_state_bytes": held.state_bytes()}
    planned_ir = planned_module(planned.step.ir, planned.passes)
    out["planned_peak_bytes"] = planned_bytes(planned_ir)
    out["peak_bytes"] = out["param_bytes"] + out["optimizer_state_bytes"] + out["planned_peak_bytes"]
    # what loading TVM, torch.export and MPI added to this process (measured when they loaded:
    # raf_dist.process_memory) as a run holds it: planning made the compiler's code resident
    # and left its freed heap, which a Trainer lets go after construction (after_compile), so
    # they are let go here too; MPI is loaded (not started) as the run's Trainer loads it.
    load_mpi()
    process_memory.after_compile()
    # what the step's host kernels outside the planner (BLAS GEMMs, the convolutions' im2col)
    # keep and leave free, measured as a run's first and later steps show them: each runs at
    # the step's shapes on zero operands, in a child process with the threads a rank of this
    # run gets (runtime/host_kernels.py); a Trainer or a step already in this process adds
    # its own measured terms
    from ..runtime import host_kernels
    from ..runtime.threads import threads_per_rank

    kernels = host_kernels.measure(host_kernels.host_calls(planned_ir),
                                   threads_per_rank(ranks_per_host or int(world_size)))
    out["library_bytes"] = sum(process_memory.library_bytes().values())
    out["runtime_bytes"] = process_memory.runtime_bytes() + kernels["runtime_bytes"]
    out["allocator_free_bytes"] = (process_memory.allocator_free_bytes()
                                   + kernels["allocator_free_bytes"])
    out["process_bytes"] = (out["peak_bytes"] + out["library_bytes"] + out["runtime_bytes"]
                            + out["allocator_free_bytes"])
    return out


def _fmt(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1024 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024.0
    return str(nbytes)


def _table(rows: Sequence[Mapping[str, int]]) -> str:
    header = ["ranks", "level", "params", "grads", "optim state", "model states",
              "temporaries", "peak/rank", "+libraries"]
    lines = [header] + [[str(r["world_size"]), str(r["level"]), _fmt(r["param_bytes"]),
                         _fmt(r["grad_bytes"]), _fmt(r["optimizer_state_bytes"]),
                         _fmt(r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"]),
                         _fmt(r.get("planned_peak_bytes")), _fmt(r.get("peak_bytes")),
                         _fmt(r.get("process_bytes"))]
                        for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def _load_script(path: str) -> Model:
    spec = importlib.util.spec_from_file_location("raf_dist_user_model", path)
    if spec is None or spec.loader is None:  # a name without .py: no loader for it
        raise SystemExit(f"{path} is not a Python file: give a .py script defining get_model()")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_model"):
        raise SystemExit(f"{path} must define get_model() returning a raf_dist Model (from "
                         "raf_dist.frontend.from_pytorch or from_relax_nn), captured with the "
                         "per-rank batch")
    return module.get_model()


def _optimizer(name: str) -> Optimizer:
    from .. import optim
    return {"sgd": lambda: optim.SGD(0.1), "sgd_momentum": lambda: optim.SGD(0.1, momentum=0.9),
            "adam": lambda: optim.Adam(), "adamw": lambda: optim.AdamW()}[name]()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raf_dist.tools.estimate_memory",
                                     description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="parameter count (model states only)")
    what.add_argument("--script", help="a Python file defining get_model() -> raf_dist.Model")
    parser.add_argument("--optimizer", choices=sorted(_STATES_PER_PARAM), default="adam")
    parser.add_argument("--world-sizes", default="1,2,4,8",
                        help="comma-separated rank counts (default 1,2,4,8)")
    parser.add_argument("--levels", default="0,1,2,3", help="ZeRO levels (default 0,1,2,3)")
    parser.add_argument("--bucket-size-mb", type=float, default=25.0)
    parser.add_argument("--loss", default="cross_entropy", choices=["cross_entropy", "mse"])
    args = parser.parse_args(argv)
    try:
        sizes = [int(v) for v in args.world_sizes.split(",")]
        levels = [int(v) for v in args.levels.split(",")]
    except ValueError:
        parser.error("--world-sizes and --levels take comma-separated integers, e.g. 1,2,4")
    if any(n < 1 for n in sizes) or any(level not in (0, 1, 2, 3) for level in levels):
        parser.error("world sizes must be >= 1 and levels in 0..3")
    rows = []
    if args.params is not None:
        psi = int(args.params)
        if psi <= 0:
            parser.error("--params must be positive")
        for n in sizes:
            for level in levels:
                row = model_state_bytes([psi], n, level, _STATES_PER_PARAM[args.optimizer])
                row.update(world_size=n, level=level)
                rows.append(row)
        print(f"{psi:,} fp32 parameters, {args.optimizer} ({_STATES_PER_PARAM[args.optimizer]} "
              "state tensors per parameter); model states only (pass --script for the step's "
              "temporaries)")
    else:
        model = _load_script(args.script)
        optimizer = _optimizer(args.optimizer)
        print(f"{args.script}: {model.num_params():,} parameters, {args.optimizer}, buckets of "
              f"{args.bucket_size_mb} MB")
        for n in sizes:
            for level in levels:
                row = estimate_memory(model, optimizer, n, level, args.bucket_size_mb, args.loss)
                row.update(world_size=n, level=level)
                rows.append(row)
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
