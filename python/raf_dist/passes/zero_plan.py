"""What ShardZeRO decides before it emits a binding (passes/zero.py states the contract): the
step read and checked, the gradient buckets and the ``StateLayout`` they give, the new
parameter and state arguments, each parameter's optimizer update chain and, at level 3, which
parameters forward and backward gather in which buckets. ``plan_zero`` is a function of the
input function and the pass's arguments; it builds no binding, so every rejection of a step
happens here, before the rewrite starts."""
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import tvm
import tvm_ffi
from tvm import relax

from ..ir.attrs import LOCAL_PARAMS
from ..ir.utils import tensor_nbytes
from ..layout import StateLayout, shard_size, state_layout
from .auto_cast import LOW_DTYPES
from .bucketing import assign_buckets, marker_buckets, update_groups
from .gradient_markers import (LAYOUT_NUM_PARAMS, LAYOUT_PARAM_OFFSET, LAYOUT_STATES_PER_PARAM,
                               UPDATED_ARGUMENTS, Marker, find_markers, tensor_numel)

ELEMENTWISE_OPS = frozenset(f"relax.{name}" for name in (
    "add", "subtract", "multiply", "divide", "sqrt", "rsqrt", "negative", "power", "maximum",
    "minimum", "abs", "sign", "exp", "log", "square", "where", "greater", "less",
    "greater_equal", "less_equal", "clip", "astype", "floor_divide"))


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors exchanged together: their full types and shard sizes, in bucket order."""

    index: int
    keys: Tuple[int, ...]  # parameter indices
    types: Tuple[relax.TensorType, ...]
    shards: Tuple[int, ...]  # each tensor's shard size, ceil(numel / N)

    @classmethod
    def of(cls, index: int, keys: Sequence[int], types: Sequence[relax.TensorType],
           world_size: int) -> "Bucket":
        return cls(index, tuple(keys), tuple(types),
                   tuple(shard_size(tensor_numel(t), world_size) for t in types))

    @property
    def shard_total(self) -> int:
        return sum(self.shards)

    @property
    def dtype(self) -> str:
        return str(self.types[0].dtype)

    @property
    def split_offsets(self) -> List[int]:
        """Where each tensor's shard starts in a packed [S] buffer, after the first."""
        offsets, total = [], 0
        for s in self.shards[:-1]:
            total += s
            offsets.append(total)
        return offsets


# ---- reading the step ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    """``train_step`` as build_train_step emits it, read once: its one dataflow block, which
    arguments are parameters and states, the gradient markers and the returned tuple."""

    func: relax.Function
    offset: int  # index of the first parameter argument
    params: Tuple[relax.Var, ...]
    states: Tuple[relax.Var, ...]  # parameter-major: parameter k's states back to back
    per_param: int  # optimizer states per parameter
    bindings: Tuple[relax.Binding, ...]
    markers: Tuple[Marker, ...]  # backward order
    marker_of: Dict[int, Marker]  # parameter index -> its gradient marker
    output_var: relax.Var
    result: relax.Tuple  # (loss, *params, *states, *buffers)
    forward_end: int  # bindings <= this: forward + loss
    optimizer_begin: int  # bindings >= this: the optimizer's update
    # buffers the forward updates (BatchNorm running statistics): replicated, passed through
    buffer_outputs: Tuple[relax.Expr, ...]
    buffer_arguments: Tuple[int, ...]  # their arguments (the updated arguments' tail)
    # parameters this rank's alone (sharded embedding tables: raf_dist.local_params): no
    # marker, held and updated whole, their update chains emitted as they are
    local: Tuple[int, ...] = ()

    @property
    def loss(self) -> relax.Expr:
        return self.result.fields[0]

    def state(self, k: int, j: int) -> relax.Var:
        return self.states[k * self.per_param + j]

    def new_param_field(self, k: int) -> relax.Expr:
        """What the input step returns as parameter k's new value."""
        return self.result.fields[1 + k]

    def new_state_field(self, k: int, j: int) -> relax.Expr:
        return self.result.fields[1 + len(self.params) + k * self.per_param + j]


def _check_block_and_attrs(func: relax.Function) -> None:
    body = func.body
    if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
        raise ValueError("ShardZeRO expects train_step with one dataflow block, as "
                         "build_train_step emits it; run it before other block-splitting passes")
    if LAYOUT_PARAM_OFFSET not in (func.attrs or {}):
        raise ValueError("ShardZeRO needs train_step's layout attributes "
                         f"({LAYOUT_PARAM_OFFSET}, ...), which build_train_step sets")


def read_step(func: relax.Function) -> Step:
    """The step's parts, checked against what ShardZeRO can shard."""
    _check_block_and_attrs(func)
    attrs, body = func.attrs, func.body
    offset, num_params = int(attrs[LAYOUT_PARAM_OFFSET]), int(attrs[LAYOUT_NUM_PARAMS])
    per_param = int(attrs[LAYOUT_STATES_PER_PARAM])
    bindings = tuple(body.blocks[0].bindings)
    markers = tuple(find_markers(body.blocks[0]))
    local = tuple(sorted(int(k) for k in attrs.get(LOCAL_PARAMS, [])))
    if sorted([m.param_index for m in markers] + list(local)) != list(range(num_params)):
        raise ValueError("ShardZeRO: every parameter needs exactly one gradient marker (but "
                         "the local ones, raf_dist.local_params, which have none)")
    if not markers:
        raise ValueError("ShardZeRO: no parameter is data parallel (every one is this "
                         "rank's alone), so there is nothing to shard: use zero_opt_level=0")
    result = {b.var: b.value for b in bindings}.get(body.body)
    n_core = 1 + num_params * (1 + per_param)
    if not isinstance(result, relax.Tuple) or len(result.fields) < n_core:
        raise ValueError("ShardZeRO: train_step must return (loss, *params, *states, "
                         "*buffers)")
    buffer_outputs = tuple(result.fields[n_core:])
    updated = [int(i) for i in attrs[UPDATED_ARGUMENTS]] if UPDATED_ARGUMENTS in attrs else []
    position = {b.var: i for i, b in enumerate(bindings)}
    step = Step(
        func=func, offset=offset, params=tuple(func.params[offset:offset + num_params]),
        states=tuple(func.params[offset + num_params:offset + num_params * (1 + per_param)]),
        per_param=per_param, bindings=bindings, markers=markers,
        marker_of={m.param_index: m for m in markers}, output_var=body.body,
        result=result, forward_end=position.get(result.fields[0], -1),
        optimizer_begin=max(m.position for m in markers) + 1 if markers else 0,
        buffer_outputs=buffer_outputs,
        buffer_arguments=tuple(updated[len(updated) - len(buffer_outputs):]
                               if buffer_outputs else ()), local=local)
    return step


def _check_elementwise(step: Step, update: "UpdateChains") -> None:
    """The update is re-emitted on flat shards, which only an elementwise update allows (the
    local parameters' chains run as they are)."""
    sharded = [b for k, chain in update.chains.items() if k not in step.local for b in chain]
    for binding in list(update.shared) + sharded:
        if binding.var.same_as(step.output_var) or isinstance(binding.value, relax.Var):
            continue
        value = binding.value
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name in ELEMENTWISE_OPS):
            what = value.op.name if isinstance(value, relax.Call) and isinstance(
                value.op, tvm.ir.Op) else type(value).__name__
            raise ValueError(f"ShardZeRO: the optimizer update must be elementwise to run on "
                             f"shards; {binding.var.name} is computed by {what}")


# ---- the optimizer's update chains --------------------------------------------------------
# variable -> (parameter, its role or its position in the parameter's chain)
Owner = Dict[relax.Var, Tuple[int, Union[str, int]]]


@dataclasses.dataclass(frozen=True)
class UpdateChains:
    """The optimizer region split into one chain of bindings per parameter (what its new value
    and states are computed from), the scalar-only bindings on the function's arguments
    (hyper-parameters: ``shared``, emitted first, as any chain may read them) and the rest
    that reads no parameter's tensors but the step's own values (the accumulated loss of a
    step that ends gradient accumulation: ``tail``, emitted once backward is done)."""

    chains: Dict[int, Tuple[relax.Binding, ...]]
    shared: Tuple[relax.Binding, ...]
    tail: Tuple[relax.Binding, ...] = ()


def update_chains(step: Step) -> UpdateChains:
    """The update's chains, checked to be the same computation for every parameter up to its
    own tensors: ZeRO updates a bucket with parameter 0's chain run once on flat shards."""
    owner = _owners(step)
    chains: Dict[int, List[relax.Binding]] = {k: [] for k in range(len(step.params))}
    shared: List[relax.Binding] = []
    tail: List[relax.Binding] = []
    inputs = set(step.func.params)
    for binding in step.bindings[step.optimizer_begin:]:
        if binding.var.same_as(step.output_var):
            continue
        ks = {owner[v][0] for v in relax.analysis.free_vars(binding.value) if v in owner}
        if len(ks) > 1:
            raise ValueError(f"ShardZeRO: the optimizer update {binding.var.name} mixes "
                             "several parameters; ZeRO needs a per-parameter elementwise update")
        if not ks:
            free = set(relax.analysis.free_vars(binding.value))
            if free <= inputs | {b.var for b in shared}:
                shared.append(binding)
            else:
                tail.append(binding)
            continue
        k = ks.pop()
        owner[binding.var] = (k, len(chains[k]))
        chains[k].append(binding)
    out = UpdateChains({k: tuple(c) for k, c in chains.items()}, tuple(shared), tuple(tail))
    _check_elementwise(step, out)
    _check_one_rule(step, out, owner)
    return out


def _owners(step: Step) -> Owner:
    """Every parameter's own tensors: itself, its marked gradient and its states."""
    owner: Owner = {}
    for k, p in enumerate(step.params):
        owner[p] = (k, "param")
        if k in step.marker_of:  # (a local parameter's gradient is its chain's input)
            owner[step.marker_of[k].var] = (k, "grad")
        for j in range(step.per_param):
            owner[step.state(k, j)] = (k, f"state{j}")
    return owner


def _check_one_rule(step: Step, update: UpdateChains, owner: Owner) -> None:
    """A bucket runs its first parameter's chain for all of its parameters: refuse a step
    whose parameters are updated by different rules (different learning rates, say) unless
    they are in different optimizer parameter groups (``raf_dist.update_groups``), which
    never share a bucket (bucketing.marker_buckets)."""
    scalars = set(step.func.params) | {b.var for b in update.shared + update.tail}
    groups = update_groups(step.func) or [0] * len(step.params)
    first: Dict[int, int] = {}
    references: Dict[int, tuple] = {}
    for k in range(len(step.params)):
        if k in step.local:  # updated whole, by its own chain
            continue
        g = groups[k]
        described = _describe_chain(step, update, owner, scalars, k)
        if g not in references:
            first[g], references[g] = k, described
        elif described != references[g]:
            raise ValueError(
                f"ShardZeRO: parameter {step.params[k].name}'s update differs from "
                f"{step.params[first[g]].name}'s; ZeRO updates a bucket of parameters with one "
                "elementwise computation, so every parameter of an optimizer group needs the "
                "same update rule")


def _describe_chain(step: Step, update: UpdateChains, owner: Owner, scalars: Set[relax.Var],
                    k: int) -> tuple:
    """Parameter k's chain with its variables named by role, comparable across k."""
    local: Dict[relax.Var, int] = {}

    def name_of(v: relax.Var) -> tuple:
        return _role(v, k, local, owner, scalars)

    out = []
    for i, binding in enumerate(update.chains[k]):
        out.append(_describe(binding.value, name_of))
        local[binding.var] = i
    results = [step.new_param_field(k)] + [step.new_state_field(k, j)
                                           for j in range(step.per_param)]
    return out, [name_of(v) for v in results]


def _role(v: relax.Var, k: int, local: Dict[relax.Var, int], owner: Owner,
          scalars: Set[relax.Var]) -> tuple:
    if v in local:
        return ("local", local[v])
    if v in owner and owner[v][0] == k:
        return ("own", owner[v][1])
    return ("scalar", v) if v in scalars else ("foreign", v.name)


def _describe(value: relax.Expr, name_of: Callable[[relax.Var], tuple]) -> tuple:
    """A hashable description of an elementwise binding, variables named by ``name_of``."""
    if isinstance(value, relax.Var):
        return ("alias", name_of(value))
    args = []
    for arg in value.args:
        if isinstance(arg, relax.Var):
            args.append(name_of(arg))
        elif isinstance(arg, tvm.ir.expr.Constant):
            args.append(("const", str(arg.ty), arg.value.numpy().tobytes()))
        else:
            args.append(("expr", tvm_ffi.structural_hash(arg)))
    return (value.op.name, tvm_ffi.structural_hash(value.attrs) if value.attrs is not None else 0,
            tuple(args))


# ---- level 3 gathers ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GatherRegion:
    """Level 3: the parameters bindings of one region (forward or backward) read, in buckets
    of first-use order; each bucket is gathered just before its first use."""

    name: str
    buckets: Tuple[Bucket, ...]
    param_index: Dict[relax.Var, int]  # parameter argument the region reads -> its index
    bucket_of: Dict[int, Bucket]  # parameter index -> its bucket


_ASTYPE = tvm.ir.Op.get("relax.astype")


def low_cast(value: relax.Expr, params: Dict[relax.Var, int]) -> Optional[Tuple[int, str]]:
    """(parameter index, dtype) when ``value`` is AutoCast's low-precision copy of a
    parameter, ``astype(p, bfloat16 | float16)``; else None."""
    if (isinstance(value, relax.Call) and value.op == _ASTYPE and value.args[0] in params
            and str(value.attrs.dtype) in LOW_DTYPES):
        return params[value.args[0]], str(value.attrs.dtype)
    return None


def plan_gathers(step: Step, name: str, begin: int, end: int, world_size: int,
                 bucket_bytes: int) -> GatherRegion:
    """Buckets of the parameters read in bindings [begin, end), in first-use order. A
    parameter the region reads only as its 16-bit copy (mixed precision: AutoCast's
    ``astype``) is gathered in that dtype, its shard cast before the gather: half the bytes
    of a float32 gather. Buckets hold one dtype each; the two kinds are bucketed apart and
    the buckets ordered by their first use."""
    param_pos = {p: k for k, p in enumerate(step.params)}
    order: List[int] = []
    # parameter -> the dtypes it is read as (None: as itself)
    casts: Dict[int, Set[Optional[str]]] = {}
    for k in step.local:  # held whole: never gathered
        del param_pos[step.params[k]]
    for binding in step.bindings[begin:end]:
        cast = low_cast(binding.value, param_pos)
        for v in relax.analysis.free_vars(binding.value):
            if v in param_pos:
                k = param_pos[v]
                if k not in order:
                    order.append(k)
                casts.setdefault(k, set()).add(cast[1] if cast else None)
    gather_dtype = {k: next(iter(casts[k])) if len(casts[k]) == 1 and None not in casts[k]
                    else str(step.params[k].ty.dtype) for k in order}
    types = {k: relax.TensorType(step.params[k].ty.shape, gather_dtype[k]) for k in order}
    groups: List[List[int]] = []
    for dtype in dict.fromkeys(gather_dtype[k] for k in order):  # first-use order of dtypes
        keys = [k for k in order if gather_dtype[k] == dtype]
        groups += [[keys[i] for i in idx] for idx in assign_buckets(
            [tensor_nbytes(types[k]) for k in keys], bucket_bytes)]
    groups.sort(key=lambda g: order.index(g[0]))
    buckets = tuple(Bucket.of(b, g, [types[k] for k in g], world_size)
                    for b, g in enumerate(groups))
    return GatherRegion(name, buckets, {step.params[k]: k for k in order},
                        {k: b for b in buckets for k in b.keys})


# ---- the plan -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ZeroPlan:
    """Everything ShardZeRO decides for one step; passes/zero.py's emitter only follows it."""

    step: Step
    level: int
    update: UpdateChains
    grad_buckets: Tuple[Bucket, ...]  # backward order
    layout: StateLayout
    new_params: Tuple[relax.Var, ...]  # the parameter arguments: shards at level 3
    flat_states: Dict[Tuple[int, int], relax.Var]  # (bucket, state slot) -> [S] argument
    closes: Dict[int, Bucket]  # marker position -> the gradient bucket it completes
    forward_gathers: Optional[GatherRegion]  # level 3 only
    backward_gathers: Optional[GatherRegion]

    @property
    def state_arguments(self) -> List[relax.Var]:
        """The new optimizer-state arguments, bucket-major, then the local parameters' own
        (whole, as before)."""
        return ([self.flat_states[(b.index, j)] for b in self.grad_buckets
                 for j in range(self.step.per_param)]
                + [self.step.state(k, j) for k in self.step.local
                   for j in range(self.step.per_param)])

    def gathers_at(self, pos: int) -> GatherRegion:
        """Level 3: the region binding ``pos`` reads its parameters in."""
        region = self.forward_gathers if pos <= self.step.forward_end else self.backward_gathers
        assert region is not None, "only level 3 gathers parameters"
        return region


def plan_zero(func: relax.Function, level: int, world_size: int, bucket_bytes: int) -> ZeroPlan:
    """ShardZeRO's decisions for ``func`` (module docstring of passes/zero.py); raises
    ValueError on a step it cannot shard."""
    step = read_step(func)
    update = update_chains(step)
    params = step.params
    grad_buckets = tuple(Bucket.of(b, keys, [params[k].ty for k in keys], world_size)
                         for b, keys in enumerate(
                             marker_buckets(step.markers, bucket_bytes, update_groups(func))))
    # new arguments: parameter shards (level 3); optimizer state as one flat [S] shard per
    # bucket and state (bucket-major), the layout the update runs on, so no copy gathers or
    # scatters it around each step: raf_dist.layout's StateLayout, which the executors,
    # checkpoints and stats read too
    layout = state_layout([str(i) for i in range(len(params))],
                          [([int(d) for d in p.ty.shape], str(p.ty.dtype)) for p in params],
                          [str(j) for j in range(step.per_param)], level, world_size, 0,
                          [b.keys for b in grad_buckets], local=step.local)
    new_params = (tuple(p if layout.is_local(i) else
                        relax.Var(p.name, relax.TensorType([layout.shard_numel(i)], p.ty.dtype))
                        for i, p in enumerate(params)) if layout.params_sharded else params)
    forward = backward = None
    if level == 3:
        forward = plan_gathers(step, "forward", 0, step.forward_end + 1, world_size,
                               bucket_bytes)
        backward = plan_gathers(step, "backward", step.forward_end + 1, step.optimizer_begin,
                                world_size, bucket_bytes)
    return ZeroPlan(step=step, level=level, update=update, grad_buckets=grad_buckets,
                    layout=layout, new_params=new_params,
                    flat_states=_flat_states(step, layout),
                    closes={step.marker_of[b.keys[-1]].position: b for b in grad_buckets},
                    forward_gathers=forward, backward_gathers=backward)


def _flat_states(step: Step, layout: StateLayout) -> Dict[Tuple[int, int], relax.Var]:
    """One [S] state argument per bucket and state, named after the state it holds."""
    flat_states = {}
    for buffer in layout.state_buffers():
        if layout.is_local(buffer.params[0]):  # whole: the step's own argument
            continue
        j = int(buffer.state)
        name = step.state(buffer.params[0], j).name
        suffix = name.rsplit("__", 1)[-1] if "__" in name else f"state{j}"
        flat_states[(buffer.bucket, j)] = relax.Var(
            f"bucket{buffer.bucket}__{suffix}", relax.TensorType([buffer.numel], buffer.dtype))
    return flat_states
