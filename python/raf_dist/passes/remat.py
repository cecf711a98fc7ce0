"""Activation recomputation (rematerialization) inside the training step.

TVM's Gradient pass writes the step as the forward's bindings followed by the backward's, and
every forward value the backward reads stays alive from the forward to its last backward
use: the activations are most of a step's planned memory. This pass rewrites the adjoint so
that the backward reads *copies* of chosen forward values, recomputed from kept values right
before their first backward use; the originals then die in the forward and the memory planner
(StaticPlanBlockMemory, which sees the whole step) reuses their storage. What is kept:

- ``"full"`` (Megatron's full recomputation, RAF's rematerialization with every block
  recomputed): each block's input. A block ends at a *residual join* — a single-tensor cut of
  the forward (exactly one data-dependent value crosses it) produced by an ``add`` of two
  data-dependent values, the residual stream of transformers and ResNets; a model without one
  (a chain of layers: every position is a cut) is cut into about sqrt(n) segments of its
  n cut points (Chen et al. 2016). Values after the last block boundary (the head and the
  loss, whose backward runs right after) are kept.
- ``"selective"`` (Megatron's selective recomputation): the outputs of matmuls and
  convolutions; the cheap work between them (elementwise, normalisation, softmax, casts,
  reshapes) is recomputed.
- A memory budget's finer points (``ladder``), from none to "full": ``Cheapest(count)``
  recomputes, of the values "selective" recomputes, the ``count`` with the lowest score
  ``(recompute cost / byte + 0.1) x (backward uses + 1)`` (``ranked``; RAF's
  rematerialization chooses per tensor by this score; the cost here is modelled as the
  elements the op reads and writes), and keeps the rest as "none" does
  (``Cheapest(0)`` is none, all of them is "selective"); ``FullBlocks(count)`` recomputes the
  first ``count`` blocks as "full" does and the rest as "selective" (Megatron's
  ``--recompute-method block``; all of them is "full"). Per tensor below "selective", per
  block above it: dropping a matmul output outside a block boundary would let a recomputed
  chain run back to the step's inputs.

Under either, the outputs of collectives (tensor parallelism's allreduces, synchronized batch
norm's) and of raf_dist's markers are kept: recomputing one would repeat its communication
and change the traffic the tp plan accounts for. Values computed from the parameters alone (transposed or cast weights) are
recomputed in the backward instead of being held through the step. Dropout masks are
arguments of the step (frontend/dropout.py), and every recomputed op is a pure function of its
operands, so the recomputed values are the originals' bits: losses and parameters are
identical with and without recomputation (tests/numeric/test_remat.py).

The pass runs on the adjoint, before the step's markers, distribution and lowering, so the
collectives and memory planning of every layout see the recomputed step."""
import dataclasses
import logging
import math

import tvm
from tvm import relax

from ..ir.utils import op_name
from .gradient_markers import SubstituteVars

POLICIES = ("full", "selective")
#: ops whose outputs "selective" keeps: the ones that cost far more than the bytes they write
KEEP_OUTPUTS = ("relax.matmul", "relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d",
                "relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose")


_LOG = logging.getLogger("raf_dist")
#: ops never recomputed (module docstring): communication and raf_dist's markers
NEVER_RECOMPUTED_PREFIXES = ("raf_dist.", "relax.ccl.")


@dataclasses.dataclass(frozen=True)
class Cheapest:
    """Recompute the ``count`` lowest-scored values of "selective"'s (``ranked``), keep the
    rest: the per-tensor points between none and "selective" (module docstring)."""

    count: int


@dataclasses.dataclass(frozen=True)
class FullBlocks:
    """Recompute the first ``count`` blocks as "full" does and the rest as "selective" (every
    block boundary kept as well): the per-block points between "selective" and "full"
    (module docstring)."""

    count: int


def _free_vars(expr):
    return list(relax.analysis.free_vars(expr))


class _Forward:
    """The adjoint's first ``n_forward`` bindings (the forward and the loss) read for
    recomputation: which values depend on the data, and the single-tensor cuts."""

    def __init__(self, bindings, data_params):
        self.bindings = bindings
        self.index = {b.var: i for i, b in enumerate(bindings)}
        self.reads = [_free_vars(b.value) for b in bindings]
        data = set(data_params)
        for b, reads in zip(bindings, self.reads):
            if any(v in data for v in reads):
                data.add(b.var)
        self.data = data

    def ancestors(self, var):
        """``var`` and every forward value it is computed from."""
        seen, todo = set(), [var]
        while todo:
            v = todo.pop()
            if v in seen or v not in self.index:
                continue
            seen.add(v)
            todo.extend(self.reads[self.index[v]])
        return seen

    def cuts(self, loss):
        """Positions p (binding p starts a new segment) where exactly one data-dependent
        value on the way to ``loss`` defined before p is read at or after p, with that value.
        Values off that way (batch norm's new running statistics, which only leave the
        function) do not count: they would stay live from the first normalisation to the
        end and leave no cut."""
        on_the_way = self.ancestors(loss)
        last = {}
        for i, reads in enumerate(self.reads):
            for v in reads:
                last[v] = i
        live, cuts = set(), []
        for p in range(1, len(self.bindings)):
            var = self.bindings[p - 1].var
            if var in self.data and var in on_the_way and last.get(var, -1) >= p:
                live.add(var)
            live = {v for v in live if last[v] >= p}
            if len(live) == 1:
                cuts.append((p, next(iter(live))))
        return cuts

    def is_residual_join(self, var):
        value = self.bindings[self.index[var]].value
        return (op_name(value) == "relax.add"
                and all(isinstance(a, relax.Var) and a in self.data for a in value.args))


def _full_boundaries(fwd, loss):
    """The kept block inputs of ``"full"`` (module docstring): [(position, var)]."""
    cuts = [(p, v) for p, v in fwd.cuts(loss) if isinstance(v.ty, relax.TensorType)]
    joins = [(p, v) for p, v in cuts if fwd.is_residual_join(v)]
    if joins:
        return joins
    stride = max(1, round(math.sqrt(len(cuts))))
    return cuts[stride - 1::stride]


def _numel(ty):
    shape = getattr(ty, "shape", None)
    if not isinstance(ty, relax.TensorType) or shape is None:
        return None
    try:
        return math.prod(int(d) for d in shape)
    except TypeError:  # a symbolic dimension
        return None


def _elements_moved(value, out_numel):
    """A model of what recomputing ``value`` costs: the elements its op reads and writes (the
    values ranked are elementwise, normalisation, reduction and softmax work, bound by the
    bytes they move; a reduction's small output costs its whole input)."""
    read = sum(_numel(a.ty) or 0 for a in getattr(value, "args", ())
               if isinstance(a, relax.Expr) and isinstance(a.ty, relax.TensorType))
    return read + out_numel


def _backward_uses(fwd, backward):
    """{forward value: how many backward bindings read it}."""
    uses = {}
    for binding in backward:
        for v in _free_vars(binding.value):
            if v in fwd.index:
                uses[v] = uses.get(v, 0) + 1
    return uses


def _ranked(fwd, uses):
    """``ranked`` on a read forward and its backward uses."""
    scored = []
    for var, count in uses.items():
        value = fwd.bindings[fwd.index[var]].value
        numel = _numel(var.ty)
        if (numel is None or not isinstance(var, relax.DataflowVar)
                or op_name(value) in KEEP_OUTPUTS
                or op_name(value).startswith(NEVER_RECOMPUTED_PREFIXES)):
            continue
        size = numel * tvm.runtime.DataType(var.ty.dtype).bits // 8
        if size == 0:  # nothing to save
            continue
        score = (_elements_moved(value, numel) / size + 0.1) * (count + 1)
        scored.append((score, fwd.index[var], var))
    return [var for _, _, var in sorted(scored, key=lambda t: t[:2])]


def _read(adjoint, n_forward, n_data):
    """(the adjoint's forward read by _Forward, its backward bindings)."""
    bindings = list(adjoint.body.blocks[0].bindings)
    return _Forward(bindings[:n_forward], adjoint.params[:n_data]), bindings[n_forward:]


def ranked(adjoint, n_forward, n_data):
    """The forward values the backward reads that "selective" recomputes (not a matmul's or
    convolution's output, a collective's or a marker's; not a parameter; a tensor of known
    shape), lowest score first, score =
    ``(recompute cost per byte + 0.1) x (backward uses + 1)`` (RAF's rematerialization:
    ``(compute cost + 0.1) x (uses + 1) / size``, its cost measured per op; here modelled by
    ``_elements_moved``)."""
    fwd, backward = _read(adjoint, n_forward, n_data)
    return _ranked(fwd, _backward_uses(fwd, backward))


def ladder(adjoint, n_forward, n_data, loss):
    """(values, blocks): how many ``Cheapest`` and ``FullBlocks`` points lie between none,
    "selective" and "full" for this adjoint."""
    fwd, backward = _read(adjoint, n_forward, n_data)
    return len(_ranked(fwd, _backward_uses(fwd, backward))), len(_full_boundaries(fwd, loss))


def _selective_kept(bindings):
    return {b.var for b in bindings if op_name(b.value) in KEEP_OUTPUTS}


def rematerialize(adjoint, n_forward, n_data, policy, loss):
    """``adjoint`` (TVM's Gradient output, one dataflow block: ``n_forward`` forward and loss
    bindings, then the backward) with the backward reading recomputed copies of the forward
    values ``policy`` does not keep. ``n_data``: the adjoint's leading data arguments (inputs;
    the dropout masks and parameters after them are not data); ``loss``: the forward's loss
    value (the blocks of "full" lie on the way to it)."""
    if policy not in POLICIES and not isinstance(policy, (Cheapest, FullBlocks)):
        raise ValueError(f"recomputation policy must be one of {POLICIES}, got {policy!r}")
    if len(adjoint.body.blocks) != 1:
        raise ValueError("recomputation expects the adjoint as one dataflow block")
    bindings = list(adjoint.body.blocks[0].bindings)
    fwd, backward = _read(adjoint, n_forward, n_data)
    forward_vars = set(fwd.index)
    if isinstance(policy, Cheapest):
        # every value the backward reads, but the chosen ones (a value ranked leaves out, of
        # unknown size, is kept); the rest only where a recomputed chain reads it
        uses = _backward_uses(fwd, backward)
        chosen = set(_ranked(fwd, uses)[:policy.count])
        kept = _selective_kept(bindings[:n_forward]) | (set(uses) - chosen)
    elif policy == "full" or isinstance(policy, FullBlocks):
        boundaries = _full_boundaries(fwd, loss)
        blocks = len(boundaries) if policy == "full" else policy.count
        kept = {v for _, v in boundaries}
        if blocks >= len(boundaries):
            last = boundaries[-1][0] if boundaries else 0
            kept |= {b.var for b in bindings[last:n_forward]}  # the head and the loss
        else:  # after the count-th block: "selective"
            kept |= _selective_kept(bindings[boundaries[blocks - 1][0] if blocks else 0:
                                             n_forward])
    else:
        kept = _selective_kept(bindings[:n_forward])
    kept |= {b.var for b in bindings[:n_forward]
             if op_name(b.value).startswith(NEVER_RECOMPUTED_PREFIXES)}

    new_bindings = list(bindings[:n_forward])
    copies = {}

    def copy_of(var):
        """The recomputed copy of forward ``var`` (emitting it and what it needs first)."""
        if var in copies:
            return copies[var]
        producer = bindings[fwd.index[var]]
        mapping = {v: copy_of(v) for v in fwd.reads[fwd.index[var]] if needs_copy(v)}
        value = SubstituteVars(mapping).visit_expr(producer.value) if mapping else producer.value
        new = relax.DataflowVar(f"{var.name}_re", var.ty)
        new_bindings.append(relax.VarBinding(new, value))
        copies[var] = new
        return new

    def needs_copy(var):
        return var in forward_vars and var not in kept and isinstance(var, relax.DataflowVar)

    for binding in bindings[n_forward:]:
        mapping = {v: copy_of(v) for v in _free_vars(binding.value) if needs_copy(v)}
        if mapping:
            binding = relax.VarBinding(binding.var,
                                       SubstituteVars(mapping).visit_expr(binding.value))
        new_bindings.append(binding)
    if not copies:
        if policy in POLICIES:
            _LOG.warning("activation_checkpointing=%r recomputed nothing: %s", policy,
                         "the forward has no single-tensor cut to end a block at"
                         if policy == "full" else "the backward reads only values the policy "
                         "keeps")
    body = relax.SeqExpr([relax.DataflowBlock(new_bindings)], adjoint.body.body)
    func = relax.Function(adjoint.params, body, adjoint.ret_ty, adjoint.is_pure, adjoint.attrs)
    return relax.BlockBuilder().normalize(func)  # the new sequence's types
