"""Runtime functions called from compiled steps (registered with tvm-ffi on import)."""
from . import attention_kernels, blas, cp_kernels, sp_kernels, tp_rank  # noqa: F401
from .threads import available_cores, set_num_threads, threads_per_rank

__all__ = ["available_cores", "set_num_threads", "threads_per_rank"]
