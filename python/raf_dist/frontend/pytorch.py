"""Capture a PyTorch module through torch.export and TVM's ExportedProgram importer.

Parameter names and shapes are exactly ``module.named_parameters()``; initial values are the
module's. PyTorch is an optional dependency (``pip install -e .[torch]``).
"""
import warnings

import numpy as np

from ..model import Model


def from_pytorch(module, example_inputs):
    """Capture ``module`` called on ``example_inputs`` (a tensor or tuple of tensors).

    The captured forward has fixed input shapes: ``Trainer.step`` checks every batch against
    them. Modules with buffers (e.g. BatchNorm running statistics) are not supported yet.
    """
    try:
        import torch
        from tvm.relax.frontend.torch import from_exported_program
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("from_pytorch needs PyTorch: pip install -e .[torch]") from err
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    buffers = [name for name, _ in module.named_buffers()]
    if buffers:
        raise NotImplementedError(
            f"{type(module).__name__} has buffers {buffers[:3]}...; raf_dist trains modules "
            "whose state is all parameters (replace BatchNorm by LayerNorm/GroupNorm)")
    was_training = module.training
    module.eval()  # capture the inference graph; dropout is handled by the dropout gradient
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exported = torch.export.export(module, example_inputs)
            mod = from_exported_program(exported, keep_params_as_input=True,
                                        unwrap_unit_return_tuple=True)
    except Exception as err:
        raise ValueError(_describe_import_error(module, err)) from err
    finally:
        module.train(was_training)
    names = list(exported.graph_signature.parameters)
    named = dict(module.named_parameters())
    if sorted(names) != sorted(named):
        raise ValueError(f"torch.export lifted parameters {names}, but the module has "
                         f"{list(named)}; tied or unused parameters are not supported")
    func = mod["main"].without_attr("params")
    mod = mod.__class__({mod.get_global_var("main"): func})
    mod = _rename(mod, "main", "forward")
    init = {n: named[n].detach().cpu().numpy().copy() for n in names}
    specs = [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in example_inputs]
    return Model(mod=mod, input_specs=specs, param_names=names, init_params=init,
                 source=f"torch {type(module).__name__}")


def _rename(mod, old, new):
    import tvm

    func = mod[old].with_attr("global_symbol", new)
    return tvm.IRModule({tvm.ir.GlobalVar(new): func})


def _describe_import_error(module, err):
    text = str(err)
    if "Unsupported function type" in text or "not supported" in text.lower():
        return (f"capturing {type(module).__name__} failed: an operator is not supported by the "
                f"Relax importer: {text.strip().splitlines()[-1]}")
    return f"capturing {type(module).__name__} with torch.export failed: {text.strip()}"
