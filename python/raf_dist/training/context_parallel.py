"""A captured model as one context-parallel rank computes it (and, under sequence_parallel, with
the regions between its tensor-parallel blocks split over tp), and the host side of the split:
this rank's tokens of the inputs and targets, and a split output gathered back (DESIGN.md
section 1, "Long sequences"; the IR rewrite is passes/context_parallel.py).

The ranks of a cp group receive the same arrays (their dp slice, whole sequences) and each
keeps the tokens at its positions (runtime/cp_kernels.positions: chunks r and 2c-1-r under
the ring, chunk r under all-to-all), in that order. The forward's parameters do not change;
its sequence inputs become (B, T/c, ...), and the model captured at another batch size is
split the same way (``respecialize``).
"""
import dataclasses
from typing import Any, List, Sequence, Tuple

import numpy as np
import tvm

from ..model import Model
from ..passes.context_parallel import SequencePlan, split_sequence
from ..passes.sequence_parallel import split_between_blocks
from ..passes.tp_layout import static_shape


def positions(seq: int, cp: int, rank: int, method: str) -> np.ndarray:
    """The global positions of cp rank ``rank``'s tokens, in the order it holds them."""
    if method == "ring":
        chunk = seq // (2 * cp)
        return np.concatenate([np.arange(rank * chunk, (rank + 1) * chunk),
                               np.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])
    chunk = seq // cp
    return np.arange(rank * chunk, (rank + 1) * chunk)


def check_model(model: Model, cp: int, method: str) -> SequencePlan:
    """The plan of ``model``'s forward at ``cp`` ranks; raises (SequenceSplitError, a
    ValueError naming the fix) what cp cannot split: before any collective."""
    return split_sequence(model.forward, cp, method, len(model.input_specs), model.source)[1]


def split_model(model: Model, cp: int, method: str) -> Tuple[Model, SequencePlan]:
    """(``model`` as a cp rank computes it, the plan)."""
    functions, plan = {}, None
    for gvar, func in model.mod.functions_items():
        if gvar.name_hint in ("forward", "forward_eval"):
            func, found = split_sequence(func, cp, method, len(model.input_specs),
                                         model.source)
            plan = found if gvar.name_hint == "forward" else plan
        functions[gvar] = func
    assert plan is not None
    forward = functions[next(g for g in functions if g.name_hint == "forward")]
    specs = [(tuple(static_shape(p)), dtype) for p, (_, dtype)
             in zip(forward.params[:len(model.input_specs)], model.input_specs)]
    shapes_only = model.without_values()

    def respecialize(rows: int) -> Model:
        return split_model(shapes_only.at_batch(rows), cp, method)[0]

    return dataclasses.replace(model, mod=tvm.IRModule(functions), input_specs=specs,
                               respecialize=respecialize if model.respecialize else None
                               ), plan


def sequence_parallel_model(model: Model, tp: int) -> Model:
    """``model`` (this rank's tensor-parallel piece, cut for cp when cp > 1) with the regions
    between its tensor-parallel blocks split along the sequence over the tp ranks
    (passes/sequence_parallel.py); the model captured at another batch size alike."""
    functions = {gvar: split_between_blocks(func, tp, model.source)
                 if gvar.name_hint in ("forward", "forward_eval") else func
                 for gvar, func in model.mod.functions_items()}
    shapes_only = model.without_values()

    def respecialize(rows: int) -> Model:
        return sequence_parallel_model(shapes_only.at_batch(rows), tp)

    return dataclasses.replace(model, mod=tvm.IRModule(functions),
                               respecialize=respecialize if model.respecialize else None)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """This cp rank's cut of the host arrays: ``plan`` (the rewrite's), ``rank``."""

    plan: SequencePlan
    rank: int

    @property
    def mine(self) -> np.ndarray:
        return positions(self.plan.seq, self.plan.cp, self.rank, self.plan.method)

    def check(self, array: np.ndarray, what: str) -> None:
        if array.ndim < 2 or array.shape[1] != self.plan.seq:
            raise ValueError(
                f"{what} has shape {list(array.shape)}, but context_parallel_size="
                f"{self.plan.cp} splits axis 1, the sequence of {self.plan.seq} tokens the model "
                "was captured with: pass whole sequences (every rank of a cp group the same "
                "arrays, (batch, seq, ...)); the Trainer keeps each rank's tokens")

    def inputs(self, inputs: Sequence[Any]) -> List[Any]:
        """This rank's tokens of every input the model splits (axis 1), the others as
        given."""
        out = []
        for i, a in enumerate(inputs):
            if i in self.plan.split_inputs:
                a = np.asarray(a)
                self.check(a, f"input {i}")
                a = np.ascontiguousarray(np.take(a, self.mine, axis=1))
            out.append(a)
        return out

    def target(self, y: Any, rows: int) -> np.ndarray:
        """This rank's tokens of the target: (B, T, ...) along axis 1, or a flattened
        (B * T, ...) one row per token."""
        y = np.asarray(y)
        if y.ndim >= 1 and y.shape[0] == rows * self.plan.seq and (
                y.ndim == 1 or y.shape[1] != self.plan.seq):
            whole = y.reshape((rows, self.plan.seq) + y.shape[1:])
            return np.ascontiguousarray(np.take(whole, self.mine, axis=1)).reshape(
                (-1,) + y.shape[1:])
        self.check(y, "the target")
        return np.ascontiguousarray(np.take(y, self.mine, axis=1))

    def gather(self, local: np.ndarray, pieces: Sequence[np.ndarray]) -> np.ndarray:
        """The whole output from every cp rank's ``pieces`` (in group order) of it: the split
        dimension's segments of ``output_size`` tokens put back in sequence order."""
        dim, size = self.plan.output_dim, self.plan.output_size
        shape = local.shape
        segments = shape[dim] // (size // self.plan.cp)
        full = np.empty(shape[:dim] + (segments, size) + shape[dim + 1:], dtype=local.dtype)
        for rank, piece in enumerate(pieces):
            mine = positions(self.plan.seq, self.plan.cp, rank, self.plan.method)
            block = piece.reshape(shape[:dim] + (segments, size // self.plan.cp)
                                  + shape[dim + 1:])
            index: List[Any] = [slice(None)] * full.ndim
            index[dim + 1] = mine
            full[tuple(index)] = block
        return full.reshape(shape[:dim] + (segments * size,) + shape[dim + 1:])
