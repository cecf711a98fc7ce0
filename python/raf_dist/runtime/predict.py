"""``predict`` for both executors: the rows checked, cut into pieces of the captured batch
size (the last piece run at its own size when the model can be captured again at another
size, else padded), one compiled forward per piece size, cached.

The executors differ only in what they pass the forward (the SPMD executor: this rank's
parameters, all-ones dropout masks for a training forward, and its tp pieces gathered back;
the pipeline executor: every stage's parameters gathered first), so each hands a
``run_piece`` callable to :func:`in_pieces`.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tvm
from tvm import relax

from ..compiler import compile_step
from ..passes.auto_cast import auto_cast
from ..passes.pipeline import strip_stage_markers

Spec = Tuple[Sequence[int], str]


def check_rows(x: Any, input_specs: Sequence[Spec]) -> np.ndarray:
    """``x`` as an array of the model's (single) input, any number of rows (at least one)."""
    if len(input_specs) != 1:
        raise ValueError("predict() supports single-input models")
    shape, dtype = input_specs[0]
    x = np.asarray(x, dtype=dtype)
    if x.ndim != len(shape) or tuple(x.shape[1:]) != tuple(shape[1:]):
        raise ValueError(f"predict(): rows must have shape {tuple(shape[1:])}, got "
                         f"{tuple(x.shape[1:])}")
    if not len(x):
        raise ValueError("predict() needs at least one row, got an empty array")
    return x


def in_pieces(x: np.ndarray, batch: int, respecialize: bool,
              run_piece: Callable[[np.ndarray, int], np.ndarray]) -> np.ndarray:
    """The outputs of ``run_piece(rows_array, rows)`` over ``x`` cut into pieces of ``batch``
    rows, concatenated; ``respecialize``: whether the last, shorter piece runs at its own
    size (else it is padded with zero rows, whose outputs are cut off). An output with k rows
    per input row (nanoGPT's logits flattened to (rows * seq, vocab)) keeps k per row."""
    outputs: List[np.ndarray] = []
    for start in range(0, len(x), batch):
        piece = x[start:start + batch]
        rows = len(piece) if respecialize else batch
        if rows != len(piece):
            padded = np.zeros((rows,) + piece.shape[1:], dtype=piece.dtype)
            padded[:len(piece)] = piece
            piece = padded
        out = run_piece(np.ascontiguousarray(piece), rows)
        per_row = out.shape[0] // rows if out.ndim and out.shape[0] % rows == 0 else 1
        outputs.append(out[:min(batch, len(x) - start) * per_row])
    return np.concatenate(outputs)


class Forwards:
    """Compiled forwards of a model by rows, for ``predict``: the evaluation-mode forward
    when the model has one (running statistics), else the training forward."""

    def __init__(self, model_at: Callable[[int], Any], passes: Sequence[Any], target: Any,
                 device: Any, cache_dir: Any, compute_dtype: Optional[str] = None) -> None:
        """``compute_dtype``: the Trainer's mixed precision (passes/auto_cast.py), so that
        predict computes as the training forward does."""
        self._model_at, self._passes = model_at, list(passes)
        self._compute_dtype = compute_dtype
        self._target, self._device, self._cache_dir = target, device, cache_dir
        self._cache: Dict[int, Tuple[Any, Any]] = {}

    def sizes(self) -> List[int]:
        """The batch sizes a forward has been compiled for."""
        return sorted(self._cache)

    def at(self, rows: int) -> Tuple[Any, Any]:
        """(VM function ``forward``, the model captured at ``rows`` rows)."""
        if rows not in self._cache:
            model = self._model_at(rows)
            function = strip_stage_markers(model.forward_eval if model.forward_eval is not None
                                           else model.forward)
            if self._compute_dtype is not None:
                function = auto_cast(function, self._compute_dtype)
            mod = tvm.IRModule({tvm.ir.GlobalVar("forward"): function.with_attr(
                "global_symbol", "forward")})
            compiled = compile_step(mod, passes=self._passes, target=self._target,
                                    cache_dir=self._cache_dir)
            self._cache[rows] = (relax.VirtualMachine(compiled.executable, self._device)["forward"],
                                 model)
        return self._cache[rows]
