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
from ..training import batch_size as batching
from ..passes.auto_cast import auto_cast
from ..passes.stage_split import strip_stage_markers

Spec = Tuple[Sequence[int], str]


def check_rows(x: Any, input_specs: Sequence[Spec],
               captured_rows: Optional[int]) -> Tuple[List[np.ndarray], int]:
    """(the inputs as arrays of their captured dtypes, their rows): ``x`` is one array, or one
    per input of a multi-input model (a tuple or list, as ``step`` takes them). An input whose
    captured leading dimension is the batch (``captured_rows``) may have any number of rows
    (at least one), the same for every such input; any other input has its captured shape."""
    if captured_rows is None:
        raise ValueError("predict() cuts the rows of the model's first input, which was "
                         "captured as a scalar: capture the model with a batched first input")
    given = list(x) if isinstance(x, (tuple, list)) else [x]
    if len(input_specs) == 1 and not (len(given) == 1
                                      and np.ndim(given[0]) == len(input_specs[0][0])):
        given = [x]  # one input: rows as nested lists (or a list of rows) are one array
    if len(given) != len(input_specs):
        raise ValueError(f"predict() got {len(given)} input(s); the model was captured with "
                         f"{len(input_specs)}: pass one array per input, as a tuple, as "
                         "step() takes them")
    arrays = [np.asarray(a, dtype=dtype) for a, (_, dtype) in zip(given, input_specs)]
    rows = batching.leading_rows(arrays, input_specs, captured_rows)
    for i, (array, spec) in enumerate(zip(arrays, input_specs)):
        shape, _ = batching.batched_spec(spec, rows, captured_rows)
        if array.shape != shape:
            what = "" if len(arrays) == 1 else f"input {i}: "
            rows_only = batching.is_batched(spec, captured_rows) and array.ndim == len(shape)
            expected, got = ((f"rows must have shape {shape[1:]}", array.shape[1:]) if rows_only
                             else (f"expected shape {shape}", array.shape))
            raise ValueError(f"predict(): {what}{expected} (as captured), got {got}")
    if not rows:
        raise ValueError("predict() needs at least one row, got an empty array")
    return arrays, rows


def rows_of(inputs: Sequence[np.ndarray], specs: Sequence[Spec], captured_rows: int,
            start: int, count: int, rows: int) -> List[np.ndarray]:
    """Rows [start, start + count) of every batched input, padded to ``rows`` rows with
    copies of the inputs' first row (a row the caller passed, so valid wherever the model
    reads it: an id of its table, a non-zero norm; the padded outputs are cut off); the other
    inputs whole."""
    out = []
    for array, spec in zip(inputs, specs):
        if not batching.is_batched(spec, captured_rows):
            out.append(array)
            continue
        piece = array[start:start + count]
        if len(piece) < rows:
            piece = np.concatenate([piece, np.repeat(array[:1], rows - len(piece), axis=0)])
        out.append(np.ascontiguousarray(piece))
    return out


def in_pieces(inputs: Sequence[np.ndarray], specs: Sequence[Spec], captured_rows: int,
              respecialize: bool,
              run_piece: Callable[[List[np.ndarray], int], np.ndarray]) -> np.ndarray:
    """The outputs of ``run_piece(piece_inputs, rows)`` over the inputs' rows cut into pieces
    of ``captured_rows`` rows, concatenated; ``respecialize``: whether the last, shorter piece
    runs at its own size (else it is padded, and the padding's outputs cut off). An output
    with k rows per input row (nanoGPT's logits flattened to (rows * seq, vocab)) keeps k
    per row."""
    total = batching.leading_rows(inputs, specs, captured_rows)
    outputs: List[np.ndarray] = []
    for start in range(0, total, captured_rows):
        count = min(captured_rows, total - start)
        rows = count if respecialize else captured_rows
        out = run_piece(rows_of(inputs, specs, captured_rows, start, count, rows), rows)
        per_row = out.shape[0] // rows if out.ndim and out.shape[0] % rows == 0 else 1
        outputs.append(out[:count * per_row])
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
