"""Which arguments of an imported forward are parameters, and how PyTorch names them.

Tied parameters. One ``nn.Parameter`` used under several names (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) is lifted by torch.export once per name: ``graph_signature``
lists both targets, each with its own graph input (measured with torch 2.13:
``parameters == ('emb.weight', ..., 'head.weight')``), and TVM's importer gives each its own
Relax argument. ``tie_parameters`` keeps one argument per parameter object and substitutes
it for the others, so the forward reads one tensor in several places; TVM's Gradient pass
then sums the adjoints of every use, which is the tied parameter's gradient, as in PyTorch.
The kept argument is named as ``module.named_parameters()`` lists the parameter (its first
name); the other names are returned as aliases, because ``module.state_dict()`` (and so
``load_state_dict(strict=True)``) lists every name of a tied parameter.

Frozen parameters (``requires_grad=False``) are reported by ``frozen_parameters``; the step
builder passes them as constants (training/step.py).
"""
from tvm import relax


def tie_parameters(func: relax.Function, lifted: list, module) -> tuple:
    """Merge the arguments of tied parameters.

    ``lifted``: (argument name in ``func``, parameter name as torch.export gives it) for each
    lifted parameter, in argument order. Returns ``(func, names, aliases)``: ``func`` with one
    argument per distinct parameter (the others substituted by it), ``names`` the
    ``named_parameters()`` name of each remaining parameter argument in order, and
    ``aliases`` {other name: named_parameters() name} for every further name of a tied
    parameter (empty when nothing is tied)."""
    # every name of every parameter object, the first one being named_parameters()'s
    canonical = {}  # id(parameter) -> its named_parameters() name
    for name, param in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(param), name)
    by_name = {name: canonical[id(param)]
               for name, param in module.named_parameters(remove_duplicate=False)}
    unknown = [target for _, target in lifted if target not in by_name]
    if unknown:
        raise ValueError(f"torch.export lifted parameters {unknown} that "
                         f"{type(module).__name__}.named_parameters() does not list")
    args = {v.name: v for v in func.params}
    missing_args = [arg for arg, _ in lifted if arg not in args]
    if missing_args:
        raise ValueError(f"the imported forward has no argument for the lifted parameters "
                         f"{missing_args}")
    kept = {}  # named_parameters() name -> the argument that stays
    substitute, names = {}, []
    for arg, target in lifted:
        name = by_name[target]
        if name in kept:
            substitute[arg] = kept[name]
            continue
        kept[name] = args[arg]
        names.append(name)
    if substitute:
        func = func.bind_params(substitute)
    # every further name, lifted or not: module.state_dict() lists them all
    aliases = {n: c for n, c in by_name.items() if n != c and c in kept}
    unused = [n for n, _ in module.named_parameters() if n not in kept]
    if unused:
        raise ValueError(
            f"{type(module).__name__}'s parameters {unused} are not used by its forward on the "
            "example inputs (torch.export did not lift them); raf_dist trains the parameters "
            "forward uses: delete them, or use them in forward")
    return func, names, aliases


def frozen_parameters(module, names: list) -> list:
    """The parameters among ``names`` that PyTorch does not train (``requires_grad=False``)."""
    named = dict(module.named_parameters())
    return [n for n in names if not named[n].requires_grad]
