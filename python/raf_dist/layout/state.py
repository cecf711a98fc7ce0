"""What one rank holds of a training step's parameters and optimizer state: the
``StateLayout``, built by one pure function (``state_layout``) and read by every layer that
packs, shards, saves or counts that state.

Under ZeRO (DESIGN.md section 3) over a data-parallel axis of N ranks:

- level 0: every parameter and state whole;
- levels 1-2: parameters whole; optimizer state as one flat buffer per gradient bucket and
  state name, **bucket-major** (bucket 0's first state, bucket 0's second state, ...,
  bucket 1's first state, ...), each buffer the concatenation of the bucket's parameters'
  flat padded shards (``sharding.shard_size``), in the bucket's order. This is the layout the
  compiled update runs on (passes/zero.py builds its arguments from ``state_buffers``), so
  no step gathers or scatters state around it;
- level 3: parameters held as their flat padded shards too.

``local`` parameters (embedding tables sharded over the same dp ranks,
passes/embedding_parallel.py) are this rank's own already: at every level they are held whole,
with whole states, in no bucket; their state buffers follow the buckets' (one per parameter
and state, in parameter order).

An optimizer state is shaped like its parameter, or, for the states an optimizer keeps one
value per row of (``row_states``: row-wise Adagrad's ``sum``, as torchrec's
``RowWiseAdagrad``), ``row_state_shape``: the leading axis kept, the others 1. ZeRO cuts the
flat elements of a parameter wherever a shard ends, so a row could straddle two ranks: per-row
state is held whole, and ZeRO with such an optimizer is refused (``state_layout``).

The checkpoint format, ``Trainer.stats()`` and ``tools.estimate_memory`` read the same object,
so the rule is written once.
"""
import dataclasses
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .sharding import local_shard, shard_size, slice_range

Shape = Tuple[int, ...]
StateKey = Tuple[str, str]  # (parameter name, state name)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a TVM dtype name ("float32", "bfloat16", "int64", ...)."""
    bits = int("".join(c for c in str(dtype) if c.isdigit()) or 0)
    if bits % 8 or not bits:
        raise ValueError(f"no whole byte count for dtype {dtype!r}")
    return bits // 8


def row_state_shape(shape: Sequence[int]) -> Shape:
    """The shape of a per-row optimizer state of a parameter of ``shape``: one value per row
    of the leading axis, the other axes kept as 1 (a (rows, dim) table's is (rows, 1), as
    torchrec's RowWiseAdagrad keeps it, so it broadcasts against the row); a parameter of
    0 or 1 axes is its own rows (one value per element: plain Adagrad)."""
    shape = tuple(int(d) for d in shape)
    return shape if len(shape) < 2 else (shape[0],) + (1,) * (len(shape) - 1)


def state_shape(shape: Sequence[int], state: str, row_states: Sequence[str] = ()) -> Shape:
    """The shape of optimizer state ``state`` of a parameter of ``shape`` (module docstring)."""
    return row_state_shape(shape) if state in row_states else tuple(int(d) for d in shape)


@dataclasses.dataclass(frozen=True)
class StateBuffer:
    """One optimizer-state argument of the compiled step: ``state`` of the parameters
    ``params`` (indices), at ``offsets`` in a flat buffer of ``numel`` elements (ZeRO), or
    of one parameter whole (level 0: ``offsets`` (0,), ``numel`` the parameter's)."""

    bucket: int  # gradient bucket (ZeRO), or the parameter index (level 0)
    state: str
    params: Tuple[int, ...]
    offsets: Tuple[int, ...]
    numel: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Parameters (trainable, in the step's order) and optimizer state as this rank holds
    them (module docstring). ``dp_size`` / ``dp_rank``: the axis ZeRO shards over (1 / 0
    without it); ``buckets``: the gradient buckets (parameter indices, backward order)."""

    param_names: Tuple[str, ...]
    param_shapes: Tuple[Shape, ...]
    param_dtypes: Tuple[str, ...]
    state_names: Tuple[str, ...]
    zero_level: int
    dp_size: int
    dp_rank: int
    buckets: Tuple[Tuple[int, ...], ...]
    row_states: Tuple[str, ...] = ()  # states kept one value per row (module docstring)
    local: Tuple[int, ...] = ()  # parameters held whole at every level (module docstring)
    sparse: Tuple[int, ...] = ()  # updated on their looked-up rows: no whole gradient held

    # ---- what is held ---------------------------------------------------------------------
    @property
    def params_sharded(self) -> bool:
        """Parameters held as flat padded shards between steps (ZeRO-3)."""
        return self.zero_level == 3

    @property
    def states_sharded(self) -> bool:
        """Optimizer state held as flat padded shards, bucket-major (ZeRO-1/2/3)."""
        return self.zero_level > 0

    def numel(self, index: int) -> int:
        return int(np.prod(self.param_shapes[index], dtype=np.int64))

    def is_local(self, index: int) -> bool:
        """Whether parameter ``index`` is held whole, outside ZeRO's buckets (``local``)."""
        return index in self.local

    def shard_param(self, index: int, array: np.ndarray) -> np.ndarray:
        """What this rank holds of a full parameter (or of a state shaped like it) between
        steps under the state's sharding: its flat shard, or the whole for a local one."""
        return np.asarray(array) if self.is_local(index) else self.shard(array)

    def state_shape(self, index: int, state: str) -> Shape:
        """The full shape of optimizer state ``state`` of parameter ``index``."""
        return state_shape(self.param_shapes[index], state, self.row_states)

    def shard_numel(self, index: int) -> int:
        """Elements of this rank's flat padded shard of parameter ``index``."""
        return shard_size(self.numel(index), self.dp_size)

    def held_param_shape(self, index: int) -> Shape:
        """The shape this rank holds parameter ``index`` at between steps."""
        if self.params_sharded and not self.is_local(index):
            return (self.shard_numel(index),)
        return self.param_shapes[index]

    def slice_range(self, index: int) -> Tuple[int, int]:
        """``[begin, end)`` of parameter ``index``'s flat elements this rank's shard holds."""
        return slice_range(self.numel(index), self.dp_size, self.dp_rank)

    def shard(self, array: np.ndarray) -> np.ndarray:
        """This rank's flat padded shard of a full ``array``."""
        return local_shard(array, self.dp_size, self.dp_rank)

    def state_keys(self) -> List[StateKey]:
        """(parameter, state) in the step's per-parameter order (level 0's arguments)."""
        return [(p, s) for p in self.param_names for s in self.state_names]

    def state_buffers(self) -> List[StateBuffer]:
        """The step's optimizer-state arguments, in order."""
        dtypes = self.param_dtypes

        def whole(indices: Sequence[int]) -> List[StateBuffer]:
            return [StateBuffer(i, s, (i,), (0,),
                                int(np.prod(self.state_shape(i, s), dtype=np.int64)), dtypes[i])
                    for i in indices for s in self.state_names]

        if not self.states_sharded:
            return whole(range(len(self.param_names)))
        out = []
        for b, bucket in enumerate(self.buckets):
            offsets, total = [], 0
            for k in bucket:
                offsets.append(total)
                total += self.shard_numel(k)
            for state in self.state_names:
                out.append(StateBuffer(b, state, tuple(bucket), tuple(offsets), total,
                                       dtypes[bucket[0]]))
        return out + whole(self.local)

    def _whole_buffer(self, buffer: StateBuffer) -> bool:
        """A state buffer holding one parameter's whole state (level 0, or a local one)."""
        return not self.states_sharded or self.is_local(buffer.params[0])

    # ---- packing --------------------------------------------------------------------------
    def pack_states(self, by_key: Dict[StateKey, np.ndarray]) -> List[np.ndarray]:
        """The step's state arguments from {(param, state): array}: full arrays at level 0,
        this rank's flat shards under ZeRO (as ``shard`` cuts them)."""
        names = self.param_names
        return [np.ascontiguousarray(by_key[(names[b.params[0]], b.state)])
                if self._whole_buffer(b) else
                np.concatenate([np.asarray(by_key[(names[k], b.state)]).reshape(-1)
                                for k in b.params]) for b in self.state_buffers()]

    def unpack_states(self, arrays: Sequence[np.ndarray]) -> Dict[StateKey, np.ndarray]:
        """{(param, state): array} of what this rank holds (inverse of ``pack_states``)."""
        names, out = self.param_names, {}
        for buffer, array in zip(self.state_buffers(), arrays, strict=True):
            if self._whole_buffer(buffer):
                out[(names[buffer.params[0]], buffer.state)] = array
                continue
            flat = np.asarray(array).reshape(-1)
            for k, offset in zip(buffer.params, buffer.offsets):
                out[(names[k], buffer.state)] = flat[offset:offset + self.shard_numel(k)]
        return out

    def zero_states(self, values: Optional[Sequence[Dict[str, float]]] = None
                    ) -> Iterator[np.ndarray]:
        """The state arguments of a fresh optimizer, one at a time (the caller copies each
        to its runtime tensor before the next is made: AdamW's two moments of a model would
        otherwise exist twice at once, the largest transient of a Trainer's construction):
        zeros, or ``values[i][state]`` for the states named there of parameter ``i``
        (Adagrad's initial_accumulator_value, from the parameter's optimizer group; a ZeRO
        bucket holds one group, so its first parameter's values are the bucket's)."""
        def fill(b: StateBuffer) -> float:
            return values[b.params[0]].get(b.state, 0.0) if values else 0.0

        return (np.full(self.state_shape(b.params[0], b.state) if self._whole_buffer(b)
                        else b.numel, fill(b), b.dtype)
                for b in self.state_buffers())

    # ---- bytes ----------------------------------------------------------------------------
    def _itemsize(self, index: int) -> int:
        return dtype_bytes(self.param_dtypes[index])

    def param_bytes(self) -> int:
        """Bytes of the trainable parameters this rank holds between steps."""
        return sum(int(np.prod(self.held_param_shape(i), dtype=np.int64)) * self._itemsize(i)
                   for i in range(len(self.param_names)))

    def full_param_bytes(self) -> int:
        return sum(self.numel(i) * self._itemsize(i) for i in range(len(self.param_names)))

    def shard_param_bytes(self) -> int:
        return sum((self.numel(i) if self.is_local(i) else self.shard_numel(i))
                   * self._itemsize(i) for i in range(len(self.param_names)))

    def grad_bytes(self) -> int:
        """Gradient bytes that outlive their bucket's collective: every full gradient until
        backward ends at levels 0-1, the reduced shards at 2-3; none for a ``sparse``
        parameter (a table updated on its looked-up rows: no whole gradient is formed)."""
        whole = self.zero_level < 2
        return sum((self.numel(i) if whole or self.is_local(i) else self.shard_numel(i))
                   * self._itemsize(i) for i in range(len(self.param_names))
                   if i not in self.sparse)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state this rank holds."""
        return sum(b.numel * dtype_bytes(b.dtype) for b in self.state_buffers())


def state_layout(param_names: Sequence[str], param_specs: Sequence[Tuple[Sequence[int], str]],
                 state_names: Sequence[str], zero_level: int = 0, dp_size: int = 1,
                 dp_rank: int = 0, buckets: Sequence[Sequence[int]] = (),
                 row_states: Sequence[str] = (), local: Sequence[int] = (),
                 sparse: Sequence[int] = ()) -> StateLayout:
    """The one constructor of a :class:`StateLayout`. ``param_specs``: (shape, dtype) per
    parameter; ``buckets`` (required under ZeRO): every parameter index but the ``local``
    ones exactly once; ``row_states``: the states kept one value per row (refused under
    ZeRO); ``local``: parameters held whole at every level (module docstring); ``sparse``:
    parameters updated on their looked-up rows, whose whole gradient is never held."""
    zero_level, dp_size, dp_rank = int(zero_level), int(dp_size), int(dp_rank)
    if zero_level not in (0, 1, 2, 3):
        raise ValueError(f"zero_level must be 0, 1, 2 or 3, got {zero_level}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not a rank of a data-parallel axis of {dp_size}")
    names = tuple(param_names)
    held: Tuple[Tuple[int, ...], ...] = tuple(tuple(int(k) for k in b) for b in buckets)
    row_states = tuple(s for s in state_names if s in set(row_states))
    if zero_level and row_states:
        raise ValueError(
            f"zero_opt_level={zero_level} shards each parameter's flat elements wherever a "
            f"shard ends, which can split a row, and the optimizer keeps {list(row_states)} "
            "one value per row (row-wise Adagrad): use zero_opt_level=0 with it, or an "
            "optimizer whose state is shaped like its parameter (SGD, Adagrad, Adam, AdamW)")
    own = tuple(sorted(int(k) for k in local))
    if zero_level and sorted([k for b in held for k in b] + list(own)) != list(range(len(names))):
        raise ValueError(f"ZeRO's buckets must hold every parameter index once, got {held} "
                         f"for {len(names)} parameters (held whole: {list(own)})")
    return StateLayout(
        param_names=names,
        param_shapes=tuple(tuple(int(d) for d in s) for s, _ in param_specs),
        param_dtypes=tuple(str(d) for _, d in param_specs),
        state_names=tuple(state_names), zero_level=zero_level,
        dp_size=dp_size if zero_level else 1, dp_rank=dp_rank if zero_level else 0,
        buckets=held, row_states=row_states, local=own if zero_level else (),
        sparse=tuple(sorted(int(k) for k in sparse)))
