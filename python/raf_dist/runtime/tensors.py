"""Host arrays in and out of runtime tensors, checked before any work or collective."""
from typing import Any, Dict, Sequence, Tuple

import ml_dtypes
import numpy as np
import tvm

Spec = Tuple[Sequence[int], str]


def numpy_dtype(dtype: str) -> Any:
    """numpy's dtype for a tensor dtype name (bfloat16 is ml_dtypes', as TVM's ``numpy()``)."""
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def check_array(array: Any, spec: Spec, what: str,
                as_what: str = "as captured, with this batch's rows") -> None:
    """``array`` must have ``spec``'s shape and dtype (raised before any work or collective)."""
    shape, dtype = spec
    array_shape, array_dtype = np.shape(array), np.asarray(array).dtype
    if tuple(array_shape) != tuple(shape) or str(array_dtype) != dtype:
        raise ValueError(f"{what}: expected shape {tuple(shape)} and dtype {dtype} "
                         f"({as_what}), got shape {tuple(array_shape)} and dtype {array_dtype}")


def to_device(array: Any, spec: Spec, what: str, device: Any) -> Any:
    """A runtime tensor of ``array`` on ``device``, checked against ``spec``."""
    array = np.asarray(array)
    check_array(array, spec, what, "as captured")
    return tvm.runtime.tensor(np.ascontiguousarray(array), device)


def nbytes(tensor: Any) -> int:
    """Bytes of a runtime tensor. The pipeline's schedule counts every saved activation with
    it after each action: read from the tensor and its dtype directly (0.8 us), not through
    ``np.prod`` and a ``tvm.DataType`` parsed from the dtype's name (8 us; with ~400 calls a
    step that was 3-4 ms of bench/step_time.py's GPT under pp 2). A tuple of tensors (a saved
    attention output with its log-sum-exp: ir/attention.py) counts its fields."""
    numel = getattr(tensor, "numel", None)
    if numel is None:
        return sum(nbytes(t) for t in tensor)
    return int(numel() * tensor.dtype.itemsize)


def bytes_by_dtype(tensors: Any) -> Dict[str, int]:
    """{dtype: bytes} of runtime tensors (``stats()``: what a mixed-precision rank holds in
    float32 masters and states, and in 16-bit)."""
    totals: Dict[str, int] = {}
    for tensor in tensors:
        dtype = str(tensor.dtype)
        totals[dtype] = totals.get(dtype, 0) + nbytes(tensor)
    return totals
