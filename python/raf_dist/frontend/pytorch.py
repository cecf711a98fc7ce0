"""Capture a PyTorch module through torch.export and TVM's ExportedProgram importer.

Parameter names and shapes are exactly ``module.named_parameters()``; initial values are the
module's. PyTorch is an optional dependency (``pip install -e .[torch]``).
"""
import warnings

import numpy as np

from tvm import relax

from ..model import Model
from ..passes.dropout import dropout_marker, dropout_masks_as_inputs


def from_pytorch(module, example_inputs):
    """Capture ``module`` called on ``example_inputs`` (a tensor or tuple of tensors).

    The captured forward has fixed input shapes: ``Trainer.step`` checks every batch against
    them. The training graph is captured: each dropout becomes a multiply by a mask the
    Trainer draws every step from a seeded generator (``passes/dropout.py``). Modules with
    buffers (e.g. BatchNorm running statistics) are not supported yet.
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
    module.train()  # capture the training graph: dropout stays in it (as seeded masks)
    dropouts = []  # (rate, type) of each dropout with rate > 0, in execution order
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exported = torch.export.export(module, example_inputs)
            mod = from_exported_program(exported, keep_params_as_input=True,
                                        unwrap_unit_return_tuple=True,
                                        custom_convert_map=_dropout_converters(dropouts))
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
    if dropouts:
        func = dropout_masks_as_inputs(func, len(example_inputs), [ty for _, ty in dropouts])
    mod = mod.__class__({mod.get_global_var("main"): func})
    mod = _rename(mod, "main", "forward")
    init = {n: named[n].detach().cpu().numpy().copy() for n in names}
    specs = [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in example_inputs]
    dropout_specs = [(tuple(int(d) for d in ty.shape), str(ty.dtype), rate) for rate, ty in dropouts]
    return Model(mod=mod, input_specs=specs, param_names=names, init_params=init,
                 source=f"torch {type(module).__name__}", dropout_specs=dropout_specs)


def _dropout_converters(dropouts):
    """Importer hooks: dropout (p > 0, training) becomes a marker; see passes/dropout.py."""

    def convert(node, importer):
        x = importer.env[node.args[0]]
        rate = float(node.args[1]) if len(node.args) > 1 else 0.5
        train = bool(node.args[2]) if len(node.args) > 2 else True
        if rate == 0.0 or not train:
            return x
        dropouts.append((rate, x.ty))
        return importer.block_builder.emit(dropout_marker(x, len(dropouts) - 1))

    def convert_native(node, importer):  # native_dropout returns (output, mask)
        out = convert(node, importer)
        return importer.block_builder.emit(relax.Tuple([out, out]))

    return {"dropout.default": convert, "dropout_.default": convert,
            "native_dropout.default": convert_native}


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
