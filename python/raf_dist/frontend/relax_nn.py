"""Capture a model written with ``raf_dist.nn`` (TVM's ``relax.frontend.nn`` module API)."""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from ..model import Model, value_placeholder

if TYPE_CHECKING:
    import numpy.typing as npt
    from tvm.relax.frontend import nn


def from_relax_nn(module: nn.Module, input_specs: Sequence[tuple[Sequence[int], str]],
                  init_params: Mapping[str, npt.ArrayLike] | None = None, seed: int = 0) -> Model:
    """Capture ``module.forward`` for inputs ``input_specs`` = [(shape, dtype), ...].

    Parameter names are the module's ``named_parameters()`` names. Initial values come from
    ``init_params`` (name -> array) when given, else from parameters that already hold data,
    else a seeded uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) like torch.nn.Linear's default.
    """
    from tvm.relax.frontend import nn

    arg_names = list(inspect.signature(module.forward).parameters)
    if len(arg_names) != len(input_specs):
        raise ValueError(f"{type(module).__name__}.forward takes {arg_names}, but "
                         f"{len(input_specs)} input specs were given")
    spec = {"forward": {name: nn.spec.Tensor(list(shape), dtype)
                        for name, (shape, dtype) in zip(arg_names, input_specs)}}
    mod, params = module.export_tvm(spec=spec)
    names = [name for name, _ in params]
    rng = np.random.default_rng(seed)
    init: dict[str, np.ndarray] = {}
    for name, param in params:
        shape = tuple(int(d) for d in param.shape)
        if init_params and name in init_params:
            value = np.asarray(init_params[name], dtype=param.dtype)
        elif param.data is not None:
            value = param.data.numpy()
        else:
            fan_in = shape[-1] if len(shape) > 1 else shape[0]
            bound = 1.0 / np.sqrt(fan_in)
            value = rng.uniform(-bound, bound, shape).astype(param.dtype)
        if value.shape != shape:
            raise ValueError(f"init value for {name} has shape {value.shape}, expected {shape}")
        init[name] = value
    import tvm

    func = mod["forward"]
    mod = tvm.IRModule({tvm.ir.GlobalVar("forward"): func})
    batch = int(input_specs[0][0][0]) if len(input_specs[0][0]) else None

    # Model.at_batch gives the capture at another size this model's values: none kept here
    shapes = {name: value_placeholder(value) for name, value in init.items()}

    def at_batch(rows: int) -> Model:  # every input whose dim 0 is the batch gets ``rows`` rows
        specs = [((rows, *shape[1:]) if len(shape) and int(shape[0]) == batch else shape, dtype)
                 for shape, dtype in input_specs]
        return from_relax_nn(module, specs, init_params=shapes, seed=seed)

    return Model(mod=mod, input_specs=[(tuple(s), d) for s, d in input_specs],
                 param_names=names, init_params=init, source=f"raf_dist.nn {type(module).__name__}",
                 respecialize=at_batch)
