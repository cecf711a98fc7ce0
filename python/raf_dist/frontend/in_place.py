"""In-place operators through torch.export: what ``from_pytorch`` relies on, and the two places
where it has to step in.

``ExportedProgram.run_decompositions`` functionalizes the graph: every in-place operator
(``relu_``, ``hardswish_``, ``add_``, ``mul_``, ``copy_``, ``masked_fill_``, ``index_put_``,
``x[i] = v``, ``x += y``, in-place views such as ``t_``/``unsqueeze_``) becomes its out-of-place
form, and every later use of the written tensor, or of a view of it, reads the new value (a
``copy`` or a ``*_scatter`` into the base where a view was written). The Relax importer never
sees an in-place operator, and the in-place and out-of-place forms import identically. Two
exceptions:

1. **In-place dropout.** PyTorch decomposes ``aten.dropout`` through a Python kernel of
   ``torch._decomp`` into ``native_dropout``, which ``from_pytorch`` captures as a seeded mask
   (``frontend/dropout.py``). ``aten.dropout_`` (``nn.Dropout(p, inplace=True)``, the classifier
   of torchvision's MobileNetV2/V3 and EfficientNet, and ``F.dropout(..., inplace=True)``) has
   no such kernel: ATen's composite ``_dropout_impl<inplace=true>`` runs instead,
   ``empty_like(x).bernoulli_(1 - p).div_(1 - p)`` multiplied into x. TVM 0.27 converts
   ``empty`` as zeros and ``bernoulli.p`` as its input ("Dropout: just return input"), so the
   mask was all zeros: everything after the dropout saw zeros in every step, and only the next
   layer's bias reached the output (MobileNetV3-small: uniform logits, loss ln 10, and no
   dropout mask for the Trainer to draw). Export also leaves ``dropout_`` in the graph when
   PyTorch's runtime would skip it (eval mode, p = 0), and the decomposition must drop it
   there too. ``functional_dropout`` rewrites each in-place dropout ``op_(x, p, train)`` as
   ``x.copy_(op(x, p, train))`` before the decomposition: the out-of-place operator decomposes
   exactly as a model written out of place does (same mask, same place in execution order), and
   the ``copy_`` keeps the in-place meaning (functionalization makes later uses of x read the
   dropped value). Where the dropout is an identity (not training, p = 0) the node is removed
   and its uses read x. The feature and alpha dropouts (``nn.Dropout1d/2d/3d``,
   ``nn.AlphaDropout``, ``nn.FeatureAlphaDropout``) become their out-of-place forms likewise,
   which draw random numbers raf_dist does not capture: the importer refuses them either way
   (``torch_ops.py``), never one form and not the other.
2. **Writes to inputs and parameters.** Functionalization turns them into extra outputs of the
   program, which raf_dist does not carry (only buffers are state); ``describe_writes`` names
   the in-place operators that write each such tensor and where, for the refusal
   (``buffers.import_program``).
"""
import logging

from . import torch_ops

_LOG = logging.getLogger("raf_dist")
# the graph node of a rewritten in-place dropout keeps the operator it replaced, for messages
_REPLACED = "raf_dist_in_place_of"


def _in_place_dropouts() -> dict:
    """{in-place dropout operator: its out-of-place form}; both take (input, p, train)."""
    import torch

    aten = torch.ops.aten
    return {aten.dropout_.default: aten.dropout.default,
            aten.feature_dropout_.default: aten.feature_dropout.default,
            aten.alpha_dropout_.default: aten.alpha_dropout.default,
            aten.feature_alpha_dropout_.default: aten.feature_alpha_dropout.default}


def _arg(node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def functional_dropout(exported) -> int:
    """Rewrite, in place, each in-place dropout of ``exported`` (a torch.export ExportedProgram
    not yet decomposed) into its out-of-place form followed by ``copy_`` into the input, or
    remove it where it is an identity (module docstring, item 1). Returns how many nodes were
    rewritten or removed; a second call finds none."""
    import torch

    out_of_place = _in_place_dropouts()
    graph = exported.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        replacement = out_of_place.get(node.target) if node.op == "call_function" else None
        if replacement is None:
            continue
        x = node.args[0]
        rate, train = _arg(node, 1, "p", 0.5), _arg(node, 2, "train", True)
        identity = isinstance(rate, (int, float)) and isinstance(train, bool) and (
            not train or rate == 0)  # PyTorch returns x untouched
        _LOG.debug("%s at %s: imported as %s", node.target.name(),
                   torch_ops.module_path(node) or "the top-level module's forward",
                   "the identity" if identity else "its out-of-place form")
        if identity:
            node.replace_all_uses_with(x)
        else:
            with graph.inserting_before(node):
                dropped = graph.call_function(replacement, tuple(node.args), dict(node.kwargs))
                written = graph.call_function(torch.ops.aten.copy_.default, (x, dropped))
            for new in (dropped, written):  # shapes and module path for torch.export and messages
                new.meta.update(node.meta)
            written.meta[_REPLACED] = node.target.name()
            node.replace_all_uses_with(written)
        graph.erase_node(node)
        changed += 1
    if changed:
        exported.graph_module.recompile()
    return changed


def _written_argument(node):
    """The argument ``node`` (an aten operator call) writes in place, or None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = _arg(node, index, argument.name, None)
            return value if hasattr(value, "op") else None
    return None


def _base(node):
    """The tensor ``node`` is a view of (following view operators back), or ``node``."""
    while node.op == "call_function" and node.args and hasattr(node.args[0], "op"):
        schema = getattr(node.target, "_schema", None)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        if first is None or first.alias_info is None or first.alias_info.is_write:
            break  # not a view of its first argument
        node = node.args[0]
    return node


def describe_writes(exported, graph_input: str) -> str:
    """The in-place operators of ``exported`` (not yet decomposed) that write the graph input
    named ``graph_input`` (a user input or a lifted parameter), directly or through a view, as
    "aten.relu_ at body.act (ReLU), ..."; "" if none is found."""
    found = []
    for node in exported.graph.nodes:
        if node.op != "call_function":
            continue
        written = _written_argument(node)
        if written is None or _base(written).name != graph_input:
            continue
        name = node.meta.get(_REPLACED) or node.target.name()
        where = torch_ops.module_path(node) or "the top-level module's forward"
        text = f"{name.replace('::', '.')} at {where}"
        if text not in found:
            found.append(text)
    return ", ".join(found)
