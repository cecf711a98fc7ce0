"""A captured model: what every frontend produces and the Trainer consumes.

``mod["forward"]`` is a Relax function ``forward(*inputs, *dropout_masks, *params) -> output``
(one tensor); ``param_names`` gives the parameter order, ``init_params`` their initial values,
``dropout_specs`` the (shape, dtype, rate) of each dropout mask input (see frontend/dropout.py).

Buffers (frontend/buffers.py): the ones the forward writes (BatchNorm running statistics),
``buffer_names``, are forward's last arguments, ``forward(*inputs, *masks, *params, *buffers)``,
and forward then returns ``(output, *new_buffer_values)`` in that order; ``init_buffers`` holds
their initial values. Buffers nothing writes are IR constants, kept in ``constant_buffers`` for
``Trainer.buffers_dict``. ``mod["forward_eval"](*inputs, *params, *buffers) -> output``, when
present, is the evaluation-mode forward (running statistics) that ``Trainer.predict`` runs.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import numpy as np
import tvm

if TYPE_CHECKING:
    from tvm import relax

Shape = tuple[int, ...]
#: (shape, dtype) of one tensor
TensorSpec = tuple[Shape, str]


@dataclasses.dataclass
class Model:
    mod: tvm.IRModule
    input_specs: list[TensorSpec]  # [(shape tuple, dtype str)] of the forward inputs, in order
    param_names: list[str]  # names, in the order of forward's parameters after the inputs
    init_params: dict[str, np.ndarray]  # name -> numpy array
    source: str = "relax"  # where the model came from, for error messages
    # (shape, dtype, rate) of each dropout mask input
    dropout_specs: list[tuple[Shape, str, float]] = dataclasses.field(default_factory=list)
    # written by forward, in order
    buffer_names: list[str] = dataclasses.field(default_factory=list)
    init_buffers: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # name -> array
    constant_buffers: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # the same
    buffer_order: list[str] = dataclasses.field(default_factory=list)  # as module.named_buffers()
    # not in a state_dict
    non_persistent_buffers: list[str] = dataclasses.field(default_factory=list)
    # {other name: named_parameters() name} of each tied parameter (frontend/parameters.py):
    # one parameter, held and trained once; module.state_dict() lists every name
    tied_params: dict[str, str] = dataclasses.field(default_factory=dict)
    # parameters not trained (requires_grad=False): step constants, no gradient or state
    frozen_params: list[str] = dataclasses.field(default_factory=list)
    # tensor parallelism (training/tensor_parallel.py): the forward's output is split along its
    # last (class) dimension over this many ranks (0: whole); the loss is vocabulary parallel
    output_split_classes: int = 0
    # rows -> this model captured again with that leading (batch) dimension (the frontends set
    # it; training/batch_size.py); None: the captured shapes only
    respecialize: Callable[[int], Model] | None = dataclasses.field(default=None, repr=False,
                                                                  compare=False)

    @property
    def batch_size(self) -> int | None:
        """The captured leading (batch) dimension: the first input's dim 0."""
        shape = self.input_specs[0][0] if self.input_specs else ()
        return int(shape[0]) if len(shape) else None

    def at_batch(self, rows: int) -> Model:
        """This model with every batched input's leading dimension ``rows``: itself at the
        captured batch size, else captured again by the frontend (shapes change, the parameter
        names, shapes and order do not)."""
        rows = int(rows)
        if rows == self.batch_size:
            return self
        if self.respecialize is None:
            raise ValueError(f"{self.source} was captured with batch size {self.batch_size} "
                             f"and cannot be captured again at {rows} rows (no frontend hook); "
                             f"pass batches of {self.batch_size} rows or capture it through "
                             "raf_dist.frontend.from_pytorch / from_relax_nn")
        # the frontend's capture holds no values (frontend/pytorch.py captures a twin of the
        # module whose parameters hold no memory): the parameters are this model's
        return dataclasses.replace(self.respecialize(rows), init_params=self.init_params)

    def without_values(self) -> Model:
        """This model with its initial parameter values let go: each becomes a read-only
        placeholder of its shape and dtype that holds no memory (``np.broadcast_to`` of one
        zero). The executors keep this once their own tensors hold the parameters, so a
        Trainer holds one copy of the weights (DESIGN.md section 1, "Memory")."""
        return dataclasses.replace(self, init_params={n: value_placeholder(v)
                                                      for n, v in self.init_params.items()})

    @property
    def forward(self) -> relax.Function:
        return self.mod["forward"]

    @property
    def forward_eval(self) -> relax.Function | None:
        """The evaluation-mode forward, or None when it is the training forward."""
        return self.mod["forward_eval"] if "forward_eval" in [g.name_hint for g in
                                                              self.mod.get_global_vars()] else None

    def buffer_specs(self) -> list[TensorSpec]:
        return [(tuple(self.init_buffers[n].shape), str(self.init_buffers[n].dtype))
                for n in self.buffer_names]

    def param_specs(self) -> list[TensorSpec]:
        return [(tuple(self.init_params[n].shape), str(self.init_params[n].dtype))
                for n in self.param_names]

    def num_params(self) -> int:
        return int(sum(np.prod(v.shape) for v in self.init_params.values()))


def value_placeholder(value: np.ndarray) -> np.ndarray:
    """A read-only array of ``value``'s shape and dtype that holds no memory (every element
    is one zero: stride 0)."""
    return np.broadcast_to(np.zeros((), dtype=value.dtype), value.shape)
