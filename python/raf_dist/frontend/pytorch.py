"""Capture a PyTorch module through torch.export and TVM's ExportedProgram importer.

Parameter names and shapes are exactly ``module.named_parameters()``; initial values are the
module's. PyTorch is an optional dependency (``pip install -e .[torch]``).
"""
from __future__ import annotations

import functools
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Union

import numpy as np

from tvm import relax

from .. import process_memory
from ..ir.ops import dropout_marker
from ..model import Model
from . import buffers, decompositions, parameters, torch_ops
from .attention_pattern import fuse_eager_attention
from .dropout import dropout_masks_as_inputs

if TYPE_CHECKING:  # PyTorch is optional: imported where a capture needs it
    import torch
    import tvm

    #: one tensor, or a tuple or list of them (a single input need not be wrapped)
    ExampleInputs = Union[torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor]]

_LOG = logging.getLogger(__name__)

#: an importer hook: (FX node, TVM's ExportedProgram importer) -> the Relax value of the node
Converter = Callable[["torch.fx.Node", Any], relax.Expr]


def from_pytorch(module: torch.nn.Module, example_inputs: ExampleInputs) -> Model:
    """Capture ``module`` called on ``example_inputs`` (a tensor or tuple of tensors).

    The captured forward has the example's shapes. ``Trainer.step`` accepts any leading (batch)
    dimension: a batch of another size has its trailing dimensions and dtypes checked against
    the example's, and the module is captured again at that size (each input whose dim 0 is
    the example batch is resized; one compiled step per batch size seen, sharing the same
    parameters and optimizer state; ``Model.at_batch``). Under data parallelism the ranks
    may hold different numbers of rows (an uneven last batch): the loss is weighted so the
    result is the mean over the global batch's rows. The training graph is captured: each dropout becomes a multiply by a mask the
    Trainer draws every step from a seeded generator (``frontend/dropout.py``). Buffers nothing
    writes become IR constants; buffers the forward writes (BatchNorm running statistics) become
    state the step carries and updates as PyTorch's train mode does (``frontend/buffers.py``),
    and the evaluation-mode forward is captured too, for ``Trainer.predict``.

    The Model holds one copy of the parameters (its ``init_params``) and no reference to
    ``module``: capturing again at another batch size uses a twin of the module whose
    parameters hold no memory (``_weightless_twin``), so dropping ``module`` gives its
    tensors back.
    """
    return _capture(module, example_inputs, _weightless_twin(module))


def _capture(module: torch.nn.Module, example_inputs: ExampleInputs, twin: torch.nn.Module,
             again: bool = False) -> Model:
    """from_pytorch's capture; ``twin``: what Model.at_batch captures again; ``again``: this
    is that capture (the values are not copied: Model.at_batch supplies its own)."""
    try:
        import torch
        import tvm
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("from_pytorch needs PyTorch: pip install -e .[torch]") from err
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    torch_ops.install_unsupported_op_check()  # unknown operators name their module path
    was_training = module.training
    module.train()  # capture the training graph: dropout stays in it (as seeded masks)
    # (rate, type) of each dropout with rate > 0, in execution order
    dropouts: list[tuple[float, relax.TensorType]] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with buffers.cumulative_batch_norm(module) as cumulative, \
                    process_memory.measuring("torch.export"):  # its first use loads dynamo
                exported = torch.export.export(module, example_inputs)
            imported = buffers.import_program(
                exported, module, {**torch_ops.converters(), **_dropout_converters(dropouts),
                                   **_batch_norm_converters(exported, cumulative)})
            evaluation = None
            if imported.state_names:  # running statistics: predict() uses them (eval mode)
                module.eval()
                evaluation = buffers.import_program(
                    torch.export.export(module, example_inputs), module,
                    {**torch_ops.converters(), **_dropout_converters([])},
                    state_names=imported.state_names)
    except (NotImplementedError, torch_ops.UnsupportedOperatorError,
            torch_ops.ConversionError, decompositions.DecompositionError):
        raise  # raf_dist's own, already naming the problem (and where, and whose) and the fix
    except Exception as err:
        raise ValueError(_describe_import_error(module, err)) from err
    finally:
        module.train(was_training)
    named = dict(module.named_parameters())
    # one argument per parameter object: tied names share it (frontend/parameters.py)
    func, names, tied = _tie(imported, len(example_inputs), module)
    func = fuse_eager_attention(func)  # softmax(q k^T) v written out: the attention op
    if evaluation is not None:
        evaluation.func = fuse_eager_attention(
            _tie(evaluation, len(example_inputs), module)[0])
    if dropouts:
        func = dropout_masks_as_inputs(func, len(example_inputs), [ty for _, ty in dropouts])
    functions = {"forward": func}
    if evaluation is not None:
        functions["forward_eval"] = evaluation.func
    mod = tvm.IRModule({tvm.ir.GlobalVar(name): f.with_attr("global_symbol", name)
                        for name, f in functions.items()})
    buffer_values = {n: b.detach().cpu().numpy().copy() for n, b in module.named_buffers()}
    persistent = set(module.state_dict())
    # a snapshot of the values; the twin's are never read (Model.at_batch supplies them)
    init = {n: (named[n].detach().cpu().numpy() if again
                else named[n].detach().cpu().numpy().copy()) for n in names}
    specs = [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in example_inputs]
    dropout_specs = [(tuple(int(d) for d in ty.shape), str(ty.dtype), rate) for rate, ty in dropouts]
    return Model(mod=mod, input_specs=specs, param_names=names, init_params=init,
                 source=f"torch {type(module).__name__}", dropout_specs=dropout_specs,
                 buffer_names=list(imported.state_names),
                 init_buffers={n: buffer_values[n] for n in imported.state_names},
                 constant_buffers={n: buffer_values[n] for n in imported.constant_names},
                 buffer_order=list(buffer_values),
                 non_persistent_buffers=[n for n in buffer_values if n not in persistent],
                 tied_params=tied, frozen_params=parameters.frozen_parameters(module, names),
                 respecialize=functools.partial(_at_batch, twin, example_inputs))


def _at_batch(module: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...],
              rows: int) -> Model:
    """``module`` (a twin) captured again with ``rows`` rows: each example input whose dim 0
    is the example batch is repeated and cut to ``rows`` (real rows, so index inputs stay in
    range)."""
    batch = example_inputs[0].shape[0]

    def resize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != batch:
            return tensor
        repeats = -(-rows // batch)
        return tensor.repeat(repeats, *([1] * (tensor.dim() - 1)))[:rows].contiguous()

    return _capture(module, tuple(resize(t) for t in example_inputs), module, again=True)


def _weightless_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters are views of one ``torch.empty`` buffer per
    device, as large as the largest parameter there: capture reads only their shapes, dtypes
    and devices (torch.export traces with fake tensors), so the buffer is never written and
    holds no resident host memory. Buffers are copied (their values are IR constants). A
    module deepcopy cannot copy is returned itself (it then stays alive with the Model)."""
    import copy

    import torch

    params = {id(p): p for p in module.parameters()}  # tied parameters once
    largest: dict[Any, int] = {}
    for p in params.values():
        largest[p.device] = max(largest.get(p.device, 0), p.numel() * p.element_size())
    arenas = {device: torch.empty(size, dtype=torch.uint8, device=device)
              for device, size in largest.items()}
    memo: dict[int, Any] = {
        key: torch.nn.Parameter(
            arenas[p.device][:p.numel() * p.element_size()].view(p.dtype).view(p.shape),
            requires_grad=p.requires_grad)
        for key, p in params.items()}
    try:
        return copy.deepcopy(module, memo)
    except Exception as err:  # noqa: BLE001 - any module-specific copy failure
        _LOG.warning("%s cannot be deep-copied (%s): the Model keeps the module itself (and "
                     "its parameters' memory) for capturing it at other batch sizes",
                     type(module).__name__, err)
        return module


def _tie(imported: buffers.ImportedProgram, num_inputs: int,
         module: torch.nn.Module) -> tuple[relax.Function, list[str], dict[str, str]]:
    """(forward, parameter names, aliases) with tied parameters merged into one argument."""
    param_args = imported.func.params[num_inputs:num_inputs + len(imported.param_names)]
    lifted = [(v.name, target) for v, target in zip(param_args, imported.param_names)]
    return parameters.tie_parameters(imported.func, lifted, module)


def _batch_norm_converters(exported: torch.export.ExportedProgram,
                           cumulative: dict[float, str]) -> dict[str, Converter]:
    """Training-mode batch norm with PyTorch's running-statistics update (frontend/buffers.py)."""
    buffer_args = {s.target: s.arg.name for s in exported.graph_signature.input_specs}
    return {"_native_batch_norm_legit_functional.default":
            buffers.batch_norm_converter(cumulative, buffer_args)}


def _dropout_converters(dropouts: list[tuple[float, relax.TensorType]]) -> dict[str, Converter]:
    """Importer hooks: dropout (p > 0, training) becomes a marker; see frontend/dropout.py."""

    def convert(node: torch.fx.Node, importer: Any) -> relax.Expr:
        x = importer.env[node.args[0]]
        # an FX node's args are typed as any Argument; dropout's p is a float
        rate = float(node.args[1]) if len(node.args) > 1 else 0.5  # type: ignore[arg-type]
        train = bool(node.args[2]) if len(node.args) > 2 else True
        if rate == 0.0 or not train:
            return x
        dropouts.append((rate, x.ty))
        return importer.block_builder.emit(dropout_marker(x, len(dropouts) - 1))

    def convert_native(node: torch.fx.Node, importer: Any) -> relax.Expr:
        # native_dropout returns (output, mask)
        out = convert(node, importer)
        return importer.block_builder.emit(relax.Tuple([out, out]))

    # in-place dropout never reaches the importer: it is decomposed as dropout (in_place.py)
    return {"dropout.default": torch_ops.seeded(convert),
            "native_dropout.default": torch_ops.seeded(convert_native)}


def _rename(mod: tvm.IRModule, old: str, new: str) -> tvm.IRModule:
    import tvm

    func = mod[old].with_attr("global_symbol", new)
    return tvm.IRModule({tvm.ir.GlobalVar(new): func})


def _describe_import_error(module: torch.nn.Module, err: Exception) -> str:
    text = str(err)
    if "Unsupported function type" in text or "not supported" in text.lower():
        return (f"capturing {type(module).__name__} failed: an operator is not supported by the "
                f"Relax importer: {text.strip().splitlines()[-1]}")
    return f"capturing {type(module).__name__} with torch.export failed: {text.strip()}"
