"""Where the forward is cut into pipeline stages (DESIGN.md section 3c); stage_split.py then
writes one function per stage.

- ``ForwardGraph`` reads the forward: which bindings depend on the data (the rest depend
  only on parameters and constants: a weight's transpose, a causal mask; they are *cloned*
  into every stage that uses them, never a reason a cut is crossed), a cost per binding
  (FLOPs, and the parameters it reaches, so the embedding table and the head count), and
  every single-tensor cut point: a place in the data bindings where exactly one tensor is
  live, i.e. the next stage needs one activation from the previous ones.
- ``partition`` chooses the S - 1 cuts: at the model's markers, before the modules the user
  names (``pipeline_split_points``), or by a min-max dynamic program over the cut points that
  balances the stages' cost (every binding lands in exactly one stage: uneven layer counts
  never drop a layer). A requested cut that no single tensor crosses is reported with the
  values live there. The result is a ``StagePlan``; ``plan_like`` carries it to the same
  forward captured at another batch size.
"""
import dataclasses

import numpy as np
import tvm
from tvm import relax

from ..ir.ops import is_stage_marker

#: cost of one parameter element in the stage balance (its gradient accumulation, the
#: optimizer's read-modify-write of it and its state: Adam touches ~16 values per element)
PARAM_COST = 16.0
#: forward + backward FLOPs per forward FLOP
TRAIN_FLOPS = 3.0
#: cost of one element of a stage boundary, on both stages it joins: the activation is copied
#: out, sent, received, and its gradient comes back the same way (as a parameter element's
#: update work). Without it the balance, which looks at the most expensive stage only, could
#: cut after a GPT's output head and leave the last stage nothing but the logits to receive
#: (632 x 50257 floats per microbatch instead of 632 x 1280: found by raf_dist.proxies)
BOUNDARY_COST = PARAM_COST


# ---- reading the forward ----------------------------------------------------------------------
def _free_vars(expr):
    return [v for v in relax.analysis.free_vars(expr)]


def _is_float(ty):
    return isinstance(ty, relax.TensorType) and "float" in str(ty.dtype)


def _numel(ty):
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return int(np.prod([int(d) for d in ty.shape], dtype=np.int64))
    if isinstance(ty, relax.TupleType):
        return sum(_numel(f) for f in ty.fields)
    return 0


def binding_flops(binding):
    """Forward FLOPs of one binding: 2·M·N·K for a matmul (batched), 2·out·(in_channels ·
    kernel) for a convolution, else one per output element (elementwise, reductions, copies)."""
    value, out = binding.value, _numel(binding.var.ty)
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        name = value.op.name
        if name == "relax.matmul":
            a = value.args[0].ty
            if isinstance(a, relax.TensorType) and a.shape is not None:
                return 2 * out * int(a.shape[-1])
        if name.startswith("relax.nn.conv"):
            w = value.args[1].ty
            if isinstance(w, relax.TensorType) and w.shape is not None:
                return 2 * out * int(np.prod([int(d) for d in list(w.shape)[1:]]))
    return out


@dataclasses.dataclass
class CutPoint:
    position: int  # index in ForwardGraph.data (the cut is before data[position])
    var: relax.Var  # the one tensor live there
    cost_before: float  # cost of data[:position]


class ForwardGraph:
    """The forward's bindings read for pipelining (module docstring)."""

    def __init__(self, forward, num_inputs, num_masks, param_names, buffer_names=()):
        if len(forward.body.blocks) != 1 or not isinstance(forward.body.blocks[0],
                                                           relax.DataflowBlock):
            raise ValueError("pipelining needs the forward as one dataflow block (as the "
                             "frontends capture it)")
        self.forward = forward
        self.bindings = list(forward.body.blocks[0].bindings)
        params = list(forward.params)
        self.data_inputs = params[:num_inputs]
        self.masks = params[num_inputs:num_inputs + num_masks]
        first_buffer = num_inputs + num_masks + len(param_names)
        self.param_vars = params[num_inputs + num_masks:first_buffer]
        self.buffer_vars = params[first_buffer:]
        if len(self.buffer_vars) != len(buffer_names):
            raise ValueError(f"the forward takes {len(params)} arguments; {num_inputs} inputs, "
                             f"{num_masks} masks, {len(param_names)} parameters and "
                             f"{len(buffer_names)} buffers were named")
        self.param_names = list(param_names)
        self.buffer_names = list(buffer_names)
        self.param_of = {v: n for v, n in zip(self.param_vars, param_names)}
        self.param_of.update(zip(self.buffer_vars, buffer_names))  # reached like parameters
        self.output = forward.body.body
        # a forward that writes buffers returns (output, *new buffer values): each new value
        # leaves from the stage that computes it (its own output), never across a cut, so
        # the aliases the importer binds last (``gv_1 = lv9``) are read through
        self.buffer_roots = []
        if self.buffer_vars:
            fields = list(self.output.fields)
            self.output = fields[0]
            alias = {b.var: b.value for b in self.bindings if isinstance(b.value, relax.Var)}
            skipped = set()
            for field in fields[1:]:
                while field in alias:
                    skipped.add(field)
                    field = alias[field]
                self.buffer_roots.append(field)
            self.bindings = [b for b in self.bindings if b.var not in skipped]
        defined = {b.var: i for i, b in enumerate(self.bindings)}
        self.defined = defined
        # a binding depends on the data when it reads a data input or a data-dependent value
        data = set(self.data_inputs)
        self.reads = []
        for b in self.bindings:
            reads = _free_vars(b.value)
            self.reads.append(reads)
            if any(v in data for v in reads):
                data.add(b.var)
        self.is_data = [b.var in data for b in self.bindings]
        self.data = [i for i, d in enumerate(self.is_data) if d]  # binding indices
        # the parameters each binding reaches through parameter-only bindings
        reach = {v: {self.param_of[v]} for v in self.param_vars + self.buffer_vars}
        self.params_of_binding = []
        for b, reads in zip(self.bindings, self.reads):
            names = set().union(*(reach.get(v, set()) for v in reads)) if reads else set()
            reach[b.var] = names if not self.is_data[self.defined[b.var]] else set()
            self.params_of_binding.append(names)
        # cost: training FLOPs, plus the parameters a data binding is the first to reach
        seen = set()
        self.cost = []
        for i in self.data:
            new = self.params_of_binding[i] - seen
            seen |= new
            numel = sum(_numel(v.ty) for v in self.param_vars if self.param_of[v] in new)
            self.cost.append(TRAIN_FLOPS * binding_flops(self.bindings[i]) + PARAM_COST * numel)

    def markers(self):
        """Positions (in ``data``) right after each stage marker of the model."""
        return [k + 1 for k, i in enumerate(self.data) if is_stage_marker(self.bindings[i].value)]

    def live_at(self, position):
        """The data-dependent values (and data inputs) defined before ``data[position]`` that
        a binding at or after it, or the output, reads."""
        before = {self.bindings[i].var for i in self.data[:position]} | set(self.data_inputs)
        live = []
        for i in self.data[position:]:
            for v in self.reads[i]:
                if v in before and v not in live:
                    live.append(v)
        for v in _free_vars(self.output):
            if v in before and v not in live:
                live.append(v)
        return live

    def cut_points(self):
        """Every single-tensor cut point (ascending)."""
        points, total = [], 0.0
        for position in range(1, len(self.data)):
            total += self.cost[position - 1]
            live = self.live_at(position)
            if len(live) == 1 and isinstance(live[0].ty, relax.TensorType):
                points.append(CutPoint(position, live[0], total))
        return points

    def buffer_stage(self, k, bounds):
        """The stage (``bounds``: each stage's [begin, end) in ``data``) whose function
        returns the new value of buffer ``k``: the stage of the data binding computing it, or
        for a value computed from buffers alone (a BatchNorm's ``num_batches_tracked + 1``)
        the stage of its module's first data binding (that of its running statistics)."""
        root = self.buffer_roots[k]
        i = self.defined.get(root)
        if i is not None and self.is_data[i]:
            position = self.data.index(i)
        else:
            module = self.buffer_names[k].rpartition(".")[0]
            position = self.first_use(module) if module else None
            position = 0 if position is None else position
        return next(s for s, (a, b) in enumerate(bounds) if a <= position < b)

    def first_use(self, prefix):
        """Position (in ``data``) of the first binding that reads a parameter named
        ``prefix`` or under module ``prefix`` (directly or through parameter-only bindings)."""
        for k, i in enumerate(self.data):
            if any(n == prefix or n.startswith(prefix + ".") for n in self.params_of_binding[i]):
                return k
        return None


@dataclasses.dataclass
class StagePlan:
    """Where the forward is cut: ``cuts[s]`` is the position (in ``graph.data``) where stage
    s + 1 starts; ``costs[s]`` the stage's cost; ``params[s]`` the parameter names it holds."""

    graph: ForwardGraph
    cuts: list
    costs: list
    params: list
    how: str  # "partitioner", "split points" or "markers"

    @property
    def num_stages(self):
        return len(self.cuts) + 1

    def bounds(self, stage):
        bounds = [0] + list(self.cuts) + [len(self.graph.data)]
        return bounds[stage], bounds[stage + 1]

    def describe(self):
        """One line per stage: bindings, parameters and cost (tools/explain_plan)."""
        lines = [f"{self.num_stages} pipeline stages ({self.how}); cost = "
                 f"{TRAIN_FLOPS:g} x forward FLOPs + {PARAM_COST:g} x parameter elements "
                 f"(the partitioner adds {BOUNDARY_COST:g} x boundary elements)"]
        total = sum(self.costs) or 1.0
        for s in range(self.num_stages):
            lo, hi = self.bounds(s)
            names = self.params[s]
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6
                                            else "")
            lines.append(f"  stage {s}: bindings {lo}..{hi - 1} of {len(self.graph.data)}, "
                         f"cost {self.costs[s]:.3g} ({100 * self.costs[s] / total:.0f}%), "
                         f"parameters: {shown or '(none)'}")
        return "\n".join(lines)


def partition(graph, num_stages, split_points=None, ranks=None):
    """The StagePlan for ``num_stages`` stages (module docstring). ``ranks``: the pp ranks
    the stages are dealt to (stage s on rank s % ranks): the balance that counts boundary
    traffic is kept only if every rank gets a parameter (each rank's update needs one), else
    the stages are balanced on their compute alone."""
    points = graph.cut_points()
    by_position = {p.position: p for p in points}
    markers = graph.markers()
    if split_points:
        if len(split_points) != num_stages - 1:
            raise ValueError(f"pipeline_split_points names {len(split_points)} split points "
                             f"({list(split_points)}); {num_stages} stages need "
                             f"{num_stages - 1}")
        cuts, how, previous = [], "split points", 0
        for name in split_points:
            first = graph.first_use(name)
            if first is None:
                raise ValueError(f"pipeline_split_points: no parameter is named {name!r} or "
                                 f"lies under it; parameter names: {graph.param_names}")
            # the latest single-tensor cut before the module's first binding
            candidates = [p for p in by_position if previous < p <= first]
            if not candidates:
                live = [v.name for v in graph.live_at(first)]
                raise ValueError(
                    f"pipeline_split_points: no single tensor crosses the boundary before "
                    f"{name!r} (live there: {live}); a stage boundary must be crossed by one "
                    "activation. Choose another module or let the partitioner choose")
            previous = max(candidates)
            cuts.append(previous)
    elif markers:
        if len(markers) != num_stages - 1:
            raise ValueError(f"the model carries {len(markers)} stage markers, so it has "
                             f"{len(markers) + 1} stages; pipeline_parallel_size and "
                             f"stages per rank ask for {num_stages}")
        for m in markers:
            if m not in by_position:
                live = [v.name for v in graph.live_at(m)]
                raise ValueError(f"a stage marker is crossed by more than one value (live "
                                 f"there: {live}); move it to where one activation flows")
        cuts, how = markers, "markers"
    else:
        if len(points) < num_stages - 1:
            raise ValueError(
                f"the model has {len(points)} single-tensor cut points; {num_stages} stages "
                f"need {num_stages - 1}. Use fewer stages (pipeline_parallel_size)")
        cuts, how = _balance(graph, points, num_stages), "partitioner"
        if ranks and not _every_rank_trains(graph, cuts, num_stages, int(ranks)):
            cuts = _balance(graph, points, num_stages, boundary_cost=0.0)
    return _stage_plan(graph, cuts, how)


def _every_rank_trains(graph, cuts, num_stages, ranks):
    """Whether each pp rank's stages (stage s on rank s % ranks) reach a parameter."""
    bounds = [0] + list(cuts) + [len(graph.data)]
    reaching = _reaching_params(graph)
    holds = [False] * ranks
    for s in range(num_stages):
        if reaching[bounds[s + 1]] > reaching[bounds[s]]:
            holds[s % ranks] = True
    return all(holds)


def _reaching_params(graph):
    """Prefix counts over the forward's bindings: element k is how many of the first k read
    a parameter, so bindings [a, b) reach one iff element b exceeds element a."""
    names = set(graph.param_names)
    reaching = [0]
    for i in graph.data:
        reaching.append(reaching[-1] + bool(graph.params_of_binding[i] & names))
    return reaching


def plan_like(plan, graph):
    """``plan``'s stages on ``graph``, the same forward captured at another batch size (the
    pipeline's steps for other microbatch rows): the same cuts, checked to be single-tensor
    cut points of ``graph`` too, so every size runs the same stages with the same
    parameters."""
    if len(graph.data) != len(plan.graph.data):
        raise ValueError(
            f"the model captured at this batch size has {len(graph.data)} data bindings, the "
            f"captured one {len(plan.graph.data)}: its pipeline stages cannot be the same. "
            "Use the captured batch size")
    points = {p.position for p in graph.cut_points()}
    lost = [c for c in plan.cuts if c not in points]
    if lost:
        raise ValueError(
            f"at this batch size the stage boundaries at bindings {lost} are crossed by more "
            "than one value, so the captured stages do not apply; use the captured batch size")
    return _stage_plan(graph, plan.cuts, plan.how)


def _stage_plan(graph, cuts, how):
    """The StagePlan of ``graph`` cut at ``cuts``: each stage's cost and parameters."""
    prefix = np.concatenate([[0.0], np.cumsum(graph.cost)])
    bounds = [0] + list(cuts) + [len(graph.data)]
    costs = [float(prefix[b] - prefix[a]) for a, b in zip(bounds[:-1], bounds[1:])]
    params = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        used = set().union(*(graph.params_of_binding[i] for i in graph.data[a:b]))
        params.append([n for n in graph.param_names if n in used])
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if a == b:
            raise ValueError(f"pipeline stage {s} would be empty; use fewer stages")
    return StagePlan(graph, list(cuts), costs, params, how)


def _balance(graph, points, num_stages, boundary_cost=None):
    """Cuts minimizing the most expensive stage (dynamic program over the cut points; among
    equal maxima the smaller total of squares, so the other stages are balanced too). A
    stage's cost is its bindings' plus BOUNDARY_COST per element of the activations it
    receives and sends."""
    total = float(sum(graph.cost))
    positions = [0.0] + [p.cost_before for p in points] + [total]
    weight = BOUNDARY_COST if boundary_cost is None else boundary_cost
    edges = [0.0] + [weight * _numel(p.var.ty) for p in points] + [0.0]
    n = len(positions)
    # a stage must have something to differentiate (training/pipeline_step.py refuses one that
    # does not): a parameter, or an activation input that carries a gradient (a float one;
    # not the ids before an embedding lookup, nor the data inputs of the first stage)
    bounds = [0] + [p.position for p in points] + [len(graph.data)]
    reaching = _reaching_params(graph)
    float_in = [False] + [_is_float(p.var.ty) for p in points] + [False]

    def valid(i, j):
        return reaching[bounds[j]] > reaching[bounds[i]] or float_in[i]
    best = {(0, 0): (0.0, 0.0, None)}  # (stages so far, index) -> (max, squares, previous)
    for s in range(1, num_stages + 1):
        last = s == num_stages
        for j in ([n - 1] if last else range(1, n - 1)):
            options = []
            for i in range(n):
                if (s - 1, i) not in best or i >= j or not valid(i, j):
                    continue
                cost = positions[j] - positions[i] + edges[i] + edges[j]
                peak, squares, _ = best[(s - 1, i)]
                options.append((max(peak, cost), squares + cost * cost, i))
            if options:
                best[(s, j)] = min(options)
    if (num_stages, n - 1) not in best:
        raise ValueError(f"the model cannot be cut into {num_stages} stages that each hold a "
                         "parameter or receive a float activation (each stage needs something "
                         "to differentiate); use fewer stages (pipeline_parallel_size)")
    cuts, j, s = [], n - 1, num_stages
    while s > 0:
        _, _, i = best[(s, j)]
        if s > 1:
            cuts.append(points[i - 1].position)
        j, s = i, s - 1
    return sorted(cuts)
