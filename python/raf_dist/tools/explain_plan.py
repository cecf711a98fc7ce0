"""What tensor parallelism would do to a model, in one process (no MPI, no Trainer).

    text = raf_dist.explain_parallel_plan(model, tp=2)            # model: a captured Model
    text = raf_dist.explain_parallel_plan(model, tp=2, plan={"fc1": "colwise", "fc2": "rowwise"})

    python -m raf_dist.tools.explain_plan --tp 2 [--plan plan.json] MODEL_SPEC

``MODEL_SPEC`` is ``module.path:factory`` or ``path/to/file.py:factory``; ``factory()``
returns ``(torch_module, example_input[, target])`` (``example_input`` a tensor or a tuple of tensors,
its batch size that of one data-parallel rank). The model is captured with
``raf_dist.frontend.from_pytorch`` and the plan printed: for every parameter its placement
(colwise / rowwise / bias / split, the split dimension and segments) or why it stays
replicated, a vocabulary T does not divide padded to a multiple of T (GPT-2's 50257 rows at
T = 2: 50258, 25129 per rank), then the allreduces over tp per step. ``plan.json`` holds an explicit plan,
``{"pattern": "colwise" | "rowwise" | "replicate"}`` over module or parameter names (fnmatch
patterns), as ``Trainer(..., tensor_parallel_plan=...)`` takes it.

For example, the 4-layer GPT of the benchmarks (fused qkv attention, a gelu MLP, a
vocabulary head):

    python -m raf_dist.tools.explain_plan --tp 2 bench/step_time.py:gpt
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from ..model import Model


def explain_parallel_plan(model: Model, tp: int, plan: Mapping[str, str] | None = None,
                          loss: str = "cross_entropy") -> str:
    """The tensor-parallel plan of ``model`` at ``tp`` ranks as text
    (``TensorParallelPlan.explain()``): found on the captured graph as the Trainer finds it,
    or ``plan`` ({pattern: "colwise" | "rowwise" | "replicate"}) checked against it (a plan
    that cannot be followed raises ValueError saying why). Pure: one process, no MPI.

    ``model``: a captured :class:`raf_dist.Model` (``raf_dist.frontend.from_pytorch`` or
    ``from_relax_nn``). ``loss``: the Trainer's ``loss``; with ``"cross_entropy"`` the
    output layer may stay split along its classes (vocabulary-parallel cross-entropy).
    """
    from ..model import Model
    from ..training.tensor_parallel import make_plan

    if not isinstance(model, Model):
        raise TypeError(f"explain_parallel_plan takes a captured raf_dist Model (from "
                        f"raf_dist.frontend.from_pytorch or from_relax_nn), got "
                        f"{type(model).__name__}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    return make_plan(model, tp, plan, loss).explain()


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``module.path:factory`` or ``path/to/file.py:factory``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"MODEL_SPEC {spec!r} must be module.path:factory or "
                         "path/to/file.py:factory")
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"MODEL_SPEC {spec!r}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"_raf_dist_model_{path.stem}",
                                                             path)
        if module_spec is None or module_spec.loader is None:  # a name without .py
            raise ValueError(f"MODEL_SPEC {spec!r}: {path} is not a Python file (no .py "
                             f"suffix); rename it {path.name}.py")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))  # the file's own imports
        module_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")  # modules of the working directory, as python -m does
        module = importlib.import_module(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"MODEL_SPEC {spec!r}: {where} has no callable {name!r}")
    return factory


def capture(spec: str) -> Model:
    """The raf_dist Model of the factory named by ``spec``."""
    from .. import frontend

    made = load_factory(spec)()
    if not (isinstance(made, tuple) and len(made) in (2, 3)):
        raise ValueError(f"MODEL_SPEC {spec!r}: the factory must return (torch_module, "
                         f"example_input[, target]), got {type(made).__name__}")
    module, example = made[:2]
    example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    return frontend.from_pytorch(module, example)


def model_parser(tool: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m raf_dist.tools.<tool>``, with its MODEL_SPEC."""
    parser = argparse.ArgumentParser(prog=f"python -m raf_dist.tools.{tool}",
                                     description=f"{description} (one process, no MPI).")
    parser.add_argument("model", metavar="MODEL_SPEC",
                        help="module.path:factory or path/to/file.py:factory; factory() returns "
                             "(torch_module, example_input)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = model_parser("explain_plan", "Print the tensor-parallel plan of a model")
    parser.add_argument("--tp", type=int, required=True, help="tensor_parallel_size")
    parser.add_argument("--plan", help='JSON file with an explicit plan {"pattern": "colwise" | '
                                       '"rowwise" | "replicate"}')
    parser.add_argument("--loss", default="cross_entropy", choices=["cross_entropy", "mse"],
                        help="the Trainer's loss; cross_entropy lets the output layer split "
                             "along its classes (default: %(default)s)")
    args = parser.parse_args(argv)
    plan = None
    if args.plan:
        plan = json.loads(Path(args.plan).read_text())
        if not isinstance(plan, dict):
            parser.error(f"--plan {args.plan}: expected a JSON object {{pattern: placement}}")
    try:
        text = explain_parallel_plan(capture(args.model), args.tp, plan, loss=args.loss)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"explain_plan: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
