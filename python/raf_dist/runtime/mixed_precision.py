"""What ``Trainer(precision=...)`` means to the executors (DESIGN.md section 1, "Mixed
precision"): the compute dtype handed to ``build_train_step`` (passes/auto_cast.py casts
the forward, autodiff follows), and whether this CPU computes that dtype natively.
"""
import logging
from typing import Optional, Set

from .. import device as device_lib

_LOG = logging.getLogger("raf_dist")

#: Trainer(precision=...) -> the compute dtype (None: float32 throughout)
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
#: Trainer(grad_reduce_dtype=...)
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
_warned: Set[str] = set()


def compute_dtype(precision: str, device: str = "cpu") -> Optional[str]:
    """The low dtype of ``precision`` (None for "fp32"); logs once per process when the host
    CPU has no native instructions for it (the step still runs, converting to float32 in
    registers, and is slower than it would be in float32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]
    if dtype is not None and device_lib.parse(device)[0] == "cpu" and precision not in _warned:
        flag = {"bfloat16": "avx512_bf16", "float16": "avx512_fp16"}[dtype]
        if flag not in _cpu_flags():
            _warned.add(precision)
            _LOG.warning("precision=%r: this CPU has no %s instructions; %s is stored in "
                         "16 bits but computed in float32, which will be slower than "
                         "precision='fp32'", precision, flag, dtype)
    return dtype


def _cpu_flags() -> Set[str]:
    return set(device_lib.cpu_info("flags").split())
