"""raf_dist: a compiler-pass distributed-training framework on Apache TVM Relax.

Start with ``raf_dist.distributed`` (communicator, config, collectives). See the project
README and ``shared/DESIGN.md`` for the architecture.
"""
__version__ = "0.1.0"

from . import distributed  # noqa: F401  (the public entry point, imported eagerly: it is light)
