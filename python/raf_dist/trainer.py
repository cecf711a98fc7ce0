"""Trainer: the loop's one entry point (DESIGN.md section 1).

It reads ``dist.get_config()`` once, builds the training step (``training.build_train_step``),
turns the config into explicit pass arguments, compiles (``compiler.compile_step``) and runs the
step on the VM. Parameters and optimizer state stay in runtime tensors between steps.
"""
import os

import numpy as np
import tvm
from tvm import relax

from . import runtime  # noqa: F401  (registers raf_dist.blas.*)
from .compiler import compile_step, set_num_threads
from .distributed import get_communicator, get_config
from .optim import Optimizer
from .passes import DispatchMatmulToBLAS
from .training import LOSSES, build_train_step


class Trainer:
    """Train ``model`` (a :class:`raf_dist.model.Model`) with ``loss`` and ``optimizer``.

    ``step(x, y)`` takes this rank's slice of the global batch (numpy arrays) and returns the
    mean loss as a float; ``state_dict()`` returns the full parameters as numpy arrays.
    """

    def __init__(self, model, loss="cross_entropy", optimizer=None, device="cpu", cache_dir=None):
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; expected one of {LOSSES}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError("optimizer must be a raf_dist.optim optimizer (SGD, Adam, AdamW), "
                            f"got {optimizer!r}")
        if device != "cpu":
            raise ValueError(f"device {device!r} is not supported yet; use device='cpu'")
        config = get_config()
        config.check()
        self.config = config.as_dict()
        self.comm = get_communicator()
        if config.enable_data_parallel and self.comm.size > 1:
            raise NotImplementedError(
                "data parallelism is not available in this build yet; run with one process or "
                "set dist.get_config().enable_data_parallel = False")
        self.model = model
        self.loss = loss
        self.optimizer = optimizer
        set_num_threads(max(1, _cores() // max(1, self.comm.local_size)))

        self.ir, self.signature = build_train_step(model, loss, optimizer)
        compiled = compile_step(self.ir, passes=[DispatchMatmulToBLAS()], cache_dir=cache_dir)
        self.compiled = compiled
        self._device = tvm.cpu()
        self._vm = relax.VirtualMachine(compiled.executable, self._device)
        self._step_fn = self._vm["train_step"]
        self._params = [tvm.runtime.tensor(model.init_params[n], self._device)
                        for n in self.signature.param_names]
        self._states = [tvm.runtime.tensor(np.zeros_like(model.init_params[p]), self._device)
                        for p, _ in self.signature.state_keys()]
        self.step_count = 0
        self._hyper_dtype = self.signature.param_specs[0][1] if self._params else "float32"

    # ---- the loop -------------------------------------------------------------------------
    def step(self, x, y):
        """One optimizer step on this rank's batch; returns the mean loss."""
        inputs = x if isinstance(x, (tuple, list)) else (x,)
        if len(inputs) != self.signature.num_inputs:
            raise ValueError(f"step() got {len(inputs)} inputs; the model was captured with "
                             f"{self.signature.num_inputs}")
        args = [self._to_device(a, spec, f"input {i}")
                for i, (a, spec) in enumerate(zip(inputs, self.signature.input_specs))]
        args.append(self._to_device(y, self.signature.target_spec, "target"))
        hypers = self.optimizer.hyper_values(self.step_count + 1)
        hyper_args = [tvm.runtime.tensor(np.array(hypers[h], dtype=self._hyper_dtype), self._device)
                      for h in self.signature.hyper_names]
        out = self._step_fn(*args, *self._params, *self._states, *hyper_args)
        n = len(self._params)
        self._params = [out[1 + i] for i in range(n)]
        self._states = [out[1 + n + i] for i in range(len(self._states))]
        self.step_count += 1
        return float(out[0].numpy())

    def _to_device(self, array, spec, what):
        shape, dtype = spec
        array = np.asarray(array)
        if tuple(array.shape) != tuple(shape) or str(array.dtype) != dtype:
            raise ValueError(f"{what}: expected shape {tuple(shape)} and dtype {dtype} (as "
                             f"captured), got shape {tuple(array.shape)} and dtype {array.dtype}")
        return tvm.runtime.tensor(np.ascontiguousarray(array), self._device)

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self):
        """Full parameters by name (numpy arrays, true shapes)."""
        return {name: p.numpy() for name, p in zip(self.signature.param_names, self._params)}

    def optimizer_state_dict(self):
        """Optimizer state as {param name: {state name: array}}."""
        out = {}
        for (param, state), value in zip(self.signature.state_keys(), self._states):
            out.setdefault(param, {})[state] = value.numpy()
        return out

    def stats(self):
        """Bytes this rank holds between steps, the step's planned temporaries and traffic."""
        param_bytes = sum(_nbytes(p) for p in self._params)
        return {
            "param_bytes": param_bytes,
            "grad_bytes": param_bytes,
            "optimizer_state_bytes": sum(_nbytes(s) for s in self._states),
            "planned_peak_bytes": self.compiled.planned_peak_bytes,
            "comm_bytes_last_step": {},
        }


def _nbytes(tensor):
    return int(np.prod(tensor.shape)) * tvm.DataType(tensor.dtype).bits // 8


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
