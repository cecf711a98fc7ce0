"""raf_dist.run: torchrun-style launching without mpirun.

``config.py`` parses and checks the command line, ``agent.py`` runs a node (rendezvous of the
launchers through the store, attempts, failures, restarts), ``workers.py`` starts and ends the
node's workers, ``_worker_shim.py`` reports each worker's real exit status. The workers' side
(forming the MPI world) is ``raf_dist/distributed/rendezvous.py``.
"""
from .agent import Agent
from .config import LaunchConfig, LaunchError, parse

__all__ = ["Agent", "LaunchConfig", "LaunchError", "parse"]
