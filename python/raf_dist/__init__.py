"""raf_dist: a compiler-pass distributed-training framework on Apache TVM Relax.

    from raf_dist import distributed as dist
    model = raf_dist.frontend.from_pytorch(torch_module, example_inputs)
    trainer = raf_dist.Trainer(model, loss="cross_entropy", optimizer=raf_dist.optim.Adam(lr=1e-3))

``raf_dist.distributed`` is light; the compiler parts (which import TVM) load on first use.
Imported before torch, raf_dist sets OMP_WAIT_POLICY=PASSIVE unless the user set a policy
(raf_dist.env: a 16-bit step's GEMMs run on torch's OpenMP team between TVM's kernels).
"""
import importlib

from ._version import __version__  # noqa: E402,F401

from . import env  # noqa: F401,E402  (first: OMP_WAIT_POLICY before anything imports torch)

from . import distributed  # noqa: F401,E402
from . import process_memory  # noqa: E402

process_memory.watch_imports()  # the compiler's imports measured for stats() (process_memory.py)

_LAZY = {"Trainer": ("trainer", "Trainer"), "Model": ("model", "Model"),
         "estimate_memory": ("tools.estimate_memory", "estimate_memory"),
         "explain_parallel_plan": ("tools.explain_plan", "explain_parallel_plan")}
_LAZY_MODULES = ("frontend", "optim", "nn", "passes", "compiler", "training", "runtime", "data",
                 "tools")


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'raf_dist' has no attribute {name!r}")
