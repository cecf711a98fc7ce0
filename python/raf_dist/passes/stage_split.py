"""Pipeline stages over the captured forward (DESIGN.md section 3c): the stage markers and
the stage functions.

- ``raf_dist.pipeline_stage`` is the stage marker: an identity op registered from Python
  (``raf_dist.ir.ops.stage_boundary``) whose gradient is the mirrored marker
  ``raf_dist.pipeline_stage_grad`` (and its gradient the marker again), so a marked forward
  goes through TVM's Gradient with the cut still visible in the backward (Alpa's pipeline
  marker). A model may carry markers (``stage_boundary`` in a raf_dist.nn model,
  ``raf_dist.frontend.pipeline_split`` in a PyTorch one); a forward trained without
  pipelining has them stripped (``strip_stage_markers``).
- Where the cuts go (``ForwardGraph``, ``partition``, ``StagePlan``) is stage_partition.py.
- ``split_forward`` writes one Relax function per stage of a StagePlan,
  ``stage_s(input_or_data, *masks, *params) -> activation`` (the last returns the output);
  training/pipeline_step.py differentiates each and splits it into forward and backward.

The split happens on the forward, before autodiff, rather than on the differentiated step
(docs/design-notes.md "Pipeline split"): at a single-tensor cut the backward of a stage reads
only that stage's values and the incoming gradient, so differentiating each stage gives the
same bindings as colouring the whole adjoint, and a parameter used on two stages (tied
embeddings) gets one gradient per stage that holds it, summed across them before the update,
instead of an add binding that would straddle two stages.
"""
import typing

from tvm import relax

from ..ir.ops import is_stage_marker
from .gradient_markers import SubstituteVars


@relax.expr_functor.mutator
class _StripMarkers(relax.expr_functor.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if is_stage_marker(call) or is_stage_marker(call, backward=True):
            return call.args[0]
        return call


def strip_stage_markers(func):
    """``func`` with every stage marker replaced by its input (training without stages)."""
    if not any(is_stage_marker(b.value) or is_stage_marker(b.value, backward=True)
               for block in func.body.blocks for b in block.bindings):
        return func
    return _StripMarkers().visit_expr(func)


# ---- writing the stage functions ------------------------------------------------------------
class StageForward(typing.NamedTuple):
    """One stage's forward function and what it reads and writes."""

    function: relax.Function  # (input or data inputs, *masks, *params, *buffers) -> output
    mask_indices: list  # the model's dropout masks it reads
    param_names: list  # the parameters it reads, model order
    buffer_names: tuple = ()  # the buffers it reads, model order
    buffers_written: tuple = ()  # the buffers whose new values it returns after its output

    @property
    def num_inputs(self):
        """Its leading parameters: the activation from the stage before (or the data)."""
        return stage_input_count(self.function, len(self.mask_indices), len(self.param_names),
                                 len(self.buffer_names))

    @property
    def output_type(self):
        """The activation's type (the first of the outputs when it writes buffers)."""
        ret = self.function.ret_ty
        return ret.fields[0] if self.buffers_written else ret


def stage_input_count(function, masks, params, buffers):
    """A stage function's leading inputs: its parameters are ``(*inputs, *masks, *params,
    *buffers)``."""
    return len(function.params) - masks - params - buffers


def split_forward(plan):
    """One Relax function per stage (module docstring): ``(input or data inputs, *masks used,
    *parameters used, *buffers used) -> activation`` (the last: the forward's output), or
    ``(activation, *new buffer values)`` for a stage that updates buffers (BatchNorm's running
    statistics, on the stage that normalises). Returns [StageForward]."""
    graph = plan.graph
    bounds = [plan.bounds(s) for s in range(plan.num_stages)]
    owner = [graph.buffer_stage(k, bounds) for k in range(len(graph.buffer_vars))]
    stages = []
    for s in range(plan.num_stages):
        lo, hi = bounds[s]
        own = [graph.data[k] for k in range(lo, hi)]
        written = [k for k, o in enumerate(owner) if o == s]
        needed = set(own) | {graph.defined[graph.buffer_roots[k]] for k in written
                             if graph.buffer_roots[k] in graph.defined}
        for i in reversed(range(len(graph.bindings))):  # parameter-only values it reads
            if i in needed:
                for v in graph.reads[i]:
                    j = graph.defined.get(v)
                    if j is not None and not graph.is_data[j]:
                        needed.add(j)
        indices = sorted(needed)
        reads = set().union(*(graph.reads[i] for i in indices))
        reads |= {graph.buffer_roots[k] for k in written}  # a buffer returned unchanged
        if s == plan.num_stages - 1:
            reads |= set(relax.analysis.free_vars(graph.output))
        masks = [k for k, m in enumerate(graph.masks) if m in reads]
        names = [graph.param_of[v] for v in graph.param_vars if v in reads]
        buffers = [graph.param_of[v] for v in graph.buffer_vars if v in reads]
        foreign = [b for b in buffers
                   if owner[graph.buffer_names.index(b)] != s]
        if foreign:  # its value would have to travel between stages every microbatch
            raise NotImplementedError(
                f"pipeline stage {s} reads the buffers {foreign}, which another stage updates; "
                "a buffer must be read and written by one stage. Move the cut "
                "(pipeline_split_points) so that one stage holds the module")
        if s == 0:
            inputs = list(graph.data_inputs)
            entry = []
        else:
            cut = plan.cuts[s - 1]
            boundary = graph.live_at(cut)[0]
            inputs = [relax.Var("stage_input", boundary.ty)]
            entry = [relax.VarBinding(boundary, inputs[0])]
        out = (graph.output if s == plan.num_stages - 1
               else graph.live_at(plan.cuts[s])[0])
        params = inputs + [graph.masks[k] for k in masks] + [
            v for v in graph.param_vars if v in reads] + [
            v for v in graph.buffer_vars if v in reads]
        roots = [graph.buffer_roots[k] for k in written]

        def result(bb, sub, out=out, roots=roots):
            return relax.Tuple([sub(out), *map(sub, roots)]) if roots else sub(out)

        stages.append(StageForward(
            emit_function(f"stage{s}", params, entry + [graph.bindings[i] for i in indices],
                          result, tuple_fields=True), masks, names, buffers,
            [graph.buffer_names[k] for k in written]))
    return stages


def emit_function(name, params, bindings, result, tuple_fields=False):
    """``name(*params)``: ``bindings`` (taken from another function, reading ``params`` and
    each other) emitted again with fresh variables, so the function stands alone; ``result(bb,
    sub)`` builds its output, ``sub`` rewriting an expression over the old variables into one
    over the new. Stage markers become identities (a stage's own function has none left).
    ``tuple_fields``: a tuple result is returned as a tuple of its fields' variables (what
    AppendLoss needs to tell the backbone's first output from the rest)."""
    bb = relax.BlockBuilder()
    remap = {p: relax.Var(p.name, p.ty) for p in params}

    def sub(expr):
        return SubstituteVars(remap).visit_expr(expr)

    with bb.function(name, [remap[p] for p in params]):
        with bb.dataflow():
            for b in bindings:
                value = sub(b.value)
                if is_stage_marker(value):
                    value = value.args[0]
                remap[b.var] = bb.emit(value, name_hint=b.var.name)
            out = result(bb, sub)
            if tuple_fields and isinstance(out, relax.Tuple):
                out = relax.Tuple([bb.emit_output(field) for field in out.fields])
            else:
                out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()[name]
