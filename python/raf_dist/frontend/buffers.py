"""Module buffers through torch.export: constants, and state the forward writes.

torch.export lifts every buffer to a graph input and turns each in-place write of one (BatchNorm's
``running_mean``/``running_var``/``num_batches_tracked``) into an extra graph output, listed in
``graph_signature.buffers_to_mutate``. TVM 0.27's importer binds every buffer as a constant and
drops the mutation outputs, and its ``_native_batch_norm_legit_functional`` converter returns
zeros for the new running variance. Here, ``import_program``:

  - hands the importer a view of the program in which buffers are plain inputs and mutation
    outputs plain outputs (nothing else differs), so nothing is bound or dropped;
  - binds the buffers the forward never writes as IR constants (causal masks, rotary tables:
    no copy per step);
  - keeps the written ("state") buffers as the last arguments of the function, and returns
    ``(output, *new_state_values)`` in the same order;
  - imports training-mode batch norm as ``R.nn.batch_norm(..., training=True)`` whose second
    and third outputs are defined as PyTorch's new running mean and running variance
    (momentum, unbiased variance); ``passes/batch_norm.py`` decomposes it before autodiff.

BatchNorm with ``momentum=None`` (cumulative average) cannot be exported as it is (PyTorch
reads ``num_batches_tracked`` as a Python float); ``cumulative_batch_norm`` swaps in a sentinel
momentum per module while exporting, and the converter computes the factor
1 / (num_batches_tracked + 1) in the IR.
"""
import contextlib
import dataclasses
import types

import numpy as np
import tvm
from tvm import relax

from . import decompositions, in_place


@dataclasses.dataclass
class ImportedProgram:
    func: relax.Function  # (*inputs, *params, *state buffers) -> output | (output, *new states)
    input_names: list  # graph input names of the user inputs, in order
    param_names: list  # parameter names (module.named_parameters() spelling), in order
    state_names: list  # buffers the forward writes, in argument/output order
    constant_names: list  # buffers bound as IR constants


@contextlib.contextmanager
def cumulative_batch_norm(module):
    """While exporting: every BatchNorm with momentum=None gets the sentinel momentum -(k+1).
    Yields {sentinel: name of that module's num_batches_tracked buffer}."""
    import torch

    sentinels, changed = {}, []
    for prefix, sub in module.named_modules():
        if (isinstance(sub, torch.nn.modules.batchnorm._BatchNorm) and sub.momentum is None
                and sub.track_running_stats):
            value = -float(len(sentinels) + 1)
            sentinels[value] = f"{prefix}.num_batches_tracked" if prefix else "num_batches_tracked"
            changed.append(sub)
            sub.momentum = value
    try:
        yield sentinels
    finally:
        for sub in changed:
            sub.momentum = None


def batch_norm_converter(cumulative, buffer_args):
    """Importer hook for ``_native_batch_norm_legit_functional`` (training-mode batch norm):
    ``cumulative`` from cumulative_batch_norm, ``buffer_args`` {buffer name: graph input name}.
    Returns what the op returns: (output, save_mean, save_rstd, new_running_mean,
    new_running_var); the saved statistics are only read by PyTorch's own backward."""

    def convert(node, importer):
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        channels = int(x.ty.shape[1])
        dtype = str(x.ty.dtype)

        def arg(i, fill):
            if node.args[i] is None:
                return relax.const(np.full(channels, fill, dtype=dtype), dtype)
            return importer.env[node.args[i]]

        weight, bias = arg(1, 1.0), arg(2, 0.0)
        running_mean, running_var = importer.env[node.args[3]], importer.env[node.args[4]]
        if not bool(node.args[5]):
            raise NotImplementedError("batch norm without training statistics inside a training "
                                      "graph is not supported; call module.train()")
        momentum, eps = float(node.args[6]), float(node.args[7])
        counter = cumulative.get(momentum)
        bn = bb.emit(relax.op.nn.batch_norm(
            x, weight, bias, running_mean, running_var, axis=1, epsilon=eps, center=True,
            scale=True, momentum=1.0 if counter is not None else momentum, training=True))
        out = bb.emit(relax.TupleGetItem(bn, 0))
        new_mean = bb.emit(relax.TupleGetItem(bn, 1))
        new_var = bb.emit(relax.TupleGetItem(bn, 2))
        if counter is not None:  # cumulative average: factor 1 / (batches seen, this one included)
            placeholder = node.graph.find_nodes(op="placeholder", target=buffer_args[counter])[0]
            count = importer.env[placeholder]
            factor = bb.emit(relax.op.divide(
                relax.const(1.0, dtype),
                relax.op.astype(relax.op.add(count, relax.const(1, str(count.ty.dtype))), dtype)))
            # new_mean/new_var hold the batch statistics here (momentum 1)
            new_mean = bb.emit(relax.op.add(running_mean, relax.op.multiply(
                factor, relax.op.subtract(new_mean, running_mean))))
            new_var = bb.emit(relax.op.add(running_var, relax.op.multiply(
                factor, relax.op.subtract(new_var, running_var))))
        saved = bb.emit(relax.op.zeros(relax.ShapeExpr([channels]), dtype))
        return bb.emit(relax.Tuple([out, saved, saved, new_mean, new_var]))

    return convert


class _BuffersAsInputs:
    """The exported program as the importer should see it: buffers are user inputs (so it
    binds none of them) and buffer mutations are user outputs (so it drops none of them)."""

    def __init__(self, program):
        from torch.export.graph_signature import InputKind, OutputKind

        self._program = program
        signature = program.graph_signature
        buffers = {s.target for s in signature.input_specs if s.kind is InputKind.BUFFER}
        inputs = [types.SimpleNamespace(kind=InputKind.USER_INPUT, arg=s.arg, target=s.arg.name)
                  if s.kind is InputKind.BUFFER else s for s in signature.input_specs]
        outputs = [types.SimpleNamespace(kind=OutputKind.USER_OUTPUT, arg=s.arg, target=None)
                   for s in signature.output_specs]
        self.graph_signature = types.SimpleNamespace(input_specs=inputs, output_specs=outputs)
        # non-persistent buffers sit among the constants: leave them out, or the importer binds
        # another input under their name
        self.constants = {k: v for k, v in program.constants.items() if k not in buffers}

    def named_buffers(self):
        return iter(())

    def __getattr__(self, name):
        return getattr(self._program, name)


def import_program(exported, module, convert_map, state_names=None):
    """Import ``exported`` (not yet decomposed) with buffers handled as described above.

    ``state_names``: the buffers to keep as arguments; default: the ones this program writes
    (a training graph). An evaluation graph passes the training graph's, so both functions take
    the same arguments. Returns an :class:`ImportedProgram`."""
    from torch.export.graph_signature import InputKind, OutputKind
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    # PyTorch's table with its CPU attention decomposition corrected; a failure names PyTorch
    program = decompositions.run_decompositions(exported, type(module).__name__)
    signature = program.graph_signature
    unsupported = [s for s in signature.output_specs
                   if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION)]
    if unsupported:
        raise NotImplementedError(_describe_mutations(exported, unsupported))
    mutated = [s.target for s in signature.output_specs if s.kind is OutputKind.BUFFER_MUTATION]
    if state_names is None:
        state_names = list(mutated)
    elif not set(mutated) <= set(state_names):
        raise NotImplementedError(
            f"the evaluation forward writes buffers {sorted(set(mutated) - set(state_names))} "
            "that the training forward does not; raf_dist cannot carry them")
    mod = ExportedProgramImporter().from_exported_program(
        _BuffersAsInputs(program), keep_params_as_input=True, unwrap_unit_return_tuple=True,
        no_bind_return_tuple=False, custom_convert_map=convert_map)
    func = mod["main"].without_attr("params")
    by_arg = {p.name: p for p in func.params}
    inputs, params, buffers = [], [], {}
    for spec in signature.input_specs:
        if spec.kind is InputKind.USER_INPUT:
            inputs.append(spec.arg.name)
        elif spec.kind is InputKind.PARAMETER:
            params.append(spec.target)
        elif spec.kind is InputKind.BUFFER:
            buffers[spec.target] = spec.arg.name
    arg_of = {s.target: s.arg.name for s in signature.input_specs}
    values = dict(module.named_buffers())
    constants = [b for b in buffers if b not in state_names]
    missing = [b for b in state_names if b not in buffers]
    if missing:
        raise NotImplementedError(f"the evaluation forward does not read buffers {missing}, "
                                  "which the training forward writes")
    order = ([by_arg[n] for n in inputs] + [by_arg[arg_of[p]] for p in params]
             + [by_arg[buffers[b]] for b in state_names])
    func = relax.Function(order + [by_arg[buffers[b]] for b in constants], func.body,
                          func.ret_ty, is_pure=func.is_pure, attrs=func.attrs)
    if mutated:  # importer order: mutations first, then the output -> (output, *states)
        func = _reorder_outputs(func, [len(mutated)] + [mutated.index(b) for b in state_names])
    if constants:
        func = func.bind_params({by_arg[buffers[b]]: tvm.runtime.tensor(
            values[b].detach().cpu().numpy()) for b in constants})
    func = func.with_attr("num_input", len(inputs))
    return ImportedProgram(func, inputs, params, list(state_names), constants)


def _describe_mutations(exported, specs) -> str:
    """The refusal of a forward writing its inputs or parameters (``specs``: those outputs of the
    decomposed program), naming the in-place operators that write them (``exported``: the
    program before decomposition)."""
    placeholder = {s.target: s.arg.name for s in exported.graph_signature.input_specs
                   if s.target is not None}
    kinds = {"USER_INPUT_MUTATION": "input", "PARAMETER_MUTATION": "parameter"}
    written = []
    for spec in specs:
        writers = in_place.describe_writes(exported, placeholder.get(spec.target, spec.target))
        written.append(f"{kinds.get(spec.kind.name, spec.kind.name)} {spec.target}"
                       + (f" (by {writers})" if writers else ""))
    return (f"the forward writes its {'; '.join(written)} in place, and raf_dist carries only "
            "buffers from one step to the next. Use the out-of-place form there "
            "(inplace=False, y = x.relu() for x.relu_(), x = x + y for x += y)")


def _reorder_outputs(func, order):
    """``func`` returning the tuple (f_0, ..., f_n) now returns (f_order[0], f_order[1], ...),
    as a tuple of output variables (the form relax.training.AppendLoss accepts)."""
    seq = func.body
    block = seq.blocks[-1]
    last = block.bindings[-1]
    if not (last.var.same_as(seq.body) and isinstance(last.value, relax.Tuple)):
        raise ValueError("the imported forward does not end in its output tuple")
    bindings = list(block.bindings[:-1])
    outputs = []
    for i in order:
        field = last.value.fields[i]
        var = relax.Var(f"{last.var.name}_{len(outputs)}", field.ty)
        bindings.append(relax.VarBinding(var, field))
        outputs.append(var)
    result = relax.Tuple(outputs)
    body = relax.SeqExpr(list(seq.blocks[:-1]) + [block.__class__(bindings)], result)
    return relax.Function(func.params, body, relax.TupleType([v.ty for v in outputs]),
                          is_pure=func.is_pure, attrs=func.attrs)
