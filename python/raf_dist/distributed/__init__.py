"""Distributed runtime: process-group bootstrap, configuration and collectives.

``get_communicator()`` starts MPI (through mpi4py) on first use and hands the communicator to
the native collective runtime; ``get_config()`` holds the switches the Trainer reads once to
build its pass list; ``get_mesh()`` places this rank in the pp x dp x tp mesh and gives each
axis its process group.
"""
from .config import DistConfig, get_config
from .communicator import Communicator, get_communicator
from .mesh import ProcessMesh, get_mesh
from .collectives import (
    Handle,
    allgather,
    allreduce,
    alltoall,
    alltoallv,
    barrier,
    broadcast,
    comm_counters,
    recv,
    reduce_scatter,
    reset_comm_counters,
    send,
)

__all__ = [
    "Communicator",
    "DistConfig",
    "Handle",
    "ProcessMesh",
    "allgather",
    "allreduce",
    "alltoall",
    "alltoallv",
    "barrier",
    "broadcast",
    "comm_counters",
    "get_communicator",
    "get_config",
    "get_mesh",
    "recv",
    "reduce_scatter",
    "reset_comm_counters",
    "send",
]
