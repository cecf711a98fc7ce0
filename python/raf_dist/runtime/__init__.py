"""Runtime functions called from compiled steps (registered with tvm-ffi on import)."""
from . import blas  # noqa: F401
