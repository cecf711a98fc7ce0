"""A captured model: what every frontend produces and the Trainer consumes.

``mod["forward"]`` is a Relax function ``forward(*inputs, *dropout_masks, *params) -> output``
(one tensor); ``param_names`` gives the parameter order, ``init_params`` their initial values,
``dropout_specs`` the (shape, dtype, rate) of each dropout mask input (see passes/dropout.py).
"""
import dataclasses

import numpy as np
import tvm


@dataclasses.dataclass
class Model:
    mod: tvm.IRModule
    input_specs: list  # [(shape tuple, dtype str)] of the forward inputs, in order
    param_names: list  # names, in the order of forward's parameters after the inputs
    init_params: dict  # name -> numpy array
    source: str = "relax"  # where the model came from, for error messages
    dropout_specs: list = dataclasses.field(default_factory=list)  # [(shape, dtype, rate)]

    @property
    def forward(self):
        return self.mod["forward"]

    def param_specs(self):
        return [(tuple(self.init_params[n].shape), str(self.init_params[n].dtype))
                for n in self.param_names]

    def num_params(self):
        return int(sum(np.prod(v.shape) for v in self.init_params.values()))
