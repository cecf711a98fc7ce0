"""raf_dist's Relax passes. Each is a function of the IRModule and explicit arguments: no pass
reads a global config or a communicator (DESIGN.md section 2)."""
from .dispatch_blas import DispatchMatmulToBLAS

__all__ = ["DispatchMatmulToBLAS"]
