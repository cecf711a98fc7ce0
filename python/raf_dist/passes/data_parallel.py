"""AllReduceGradients: data parallelism as a pass.

Input: a module whose ``train_step`` has one dataflow block containing gradient markers
(``passes.gradient_markers``), as ``training.build_train_step`` emits it.
Arguments: ``world_size``, ``bucket_bytes``, ``overlap``, ``group`` (the native process-group
id, the same on every rank: the IR stays SPMD).
Output: markers removed; gradients grouped in backward order into buckets of about
``bucket_bytes``; for each bucket, its gradients are flattened into one contiguous buffer and
averaged in place with one allreduce; the loss is averaged too (global mean).
  - overlap=True: each bucket's ``raf_dist.ccl.allreduce_start`` is issued right after its
    last gradient is produced, and ``raf_dist.ccl.wait(handle, bucket)`` right before the
    first use of any of its gradients (the optimizer), so communication overlaps the rest of
    backward.
  - overlap=False: a blocking ``raf_dist.ccl.allreduce`` per bucket where the gradients are
    first used.
Collectives are impure ``call_packed`` calls, so the dataflow block is split around them and
values crossing a split become ordinary variables. The in-flight bucket is named in the wait
and read (split) only after it, so the memory planner keeps its storage until then
(DESIGN.md section 5). With world_size == 1 the pass only strips the markers.
"""
import tvm
from tvm import relax

from .gradient_markers import StripGradientMarkers, SubstituteVars, find_markers

_VOID = relax.TupleType([])
_HANDLE = tvm.ir.PrimType("int64")


def assign_buckets(sizes_bytes, bucket_bytes):
    """Group consecutive items into buckets: a bucket closes once it holds >= bucket_bytes
    (so every bucket but the last is at least bucket_bytes, like PyTorch DDP's)."""
    buckets, current, current_bytes = [], [], 0
    for i, size in enumerate(sizes_bytes):
        current.append(i)
        current_bytes += size
        if current_bytes >= bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


class _Segments:
    """Builds the new body as alternating dataflow / impure binding lists."""

    def __init__(self):
        self.segments = [("dataflow", [])]
        self.builder = relax.BlockBuilder()

    def bind(self, name, value, dataflow=True):
        value = self.builder.normalize(value)
        var = (relax.DataflowVar if dataflow else relax.Var)(name, value.ty)
        self.add(relax.VarBinding(var, value), dataflow)
        return var

    def add(self, binding, dataflow=True):
        kind = "dataflow" if dataflow else "impure"
        if self.segments[-1][0] != kind:
            self.segments.append((kind, []))
        self.segments[-1][1].append(binding)


def _flatten_bucket(seg, bucket_id, markers):
    flats = [seg.bind(f"grad_flat{m.param_index}", relax.op.reshape(m.grad, [m.numel]))
             for m in markers]
    if len(flats) == 1:
        # a fresh buffer, not a reshape view of the gradient's storage, is reduced in place
        return seg.bind(f"bucket{bucket_id}", relax.op.add(flats[0], relax.const(0, flats[0].ty.dtype)))
    return seg.bind(f"bucket{bucket_id}", relax.op.concat(flats, axis=0))


def _unflatten_bucket(seg, bucket, markers):
    """Bind each marker's own variable to its slice of the reduced bucket."""
    offsets, total = [], 0
    for m in markers[:-1]:
        total += m.numel
        offsets.append(total)
    parts = None
    if len(markers) > 1:
        parts = seg.bind(f"{bucket.name}_parts", relax.op.split(bucket, offsets, axis=0))
    for i, m in enumerate(markers):
        piece = bucket if parts is None else seg.bind(f"{bucket.name}_part{i}",
                                                      relax.TupleGetItem(parts, i))
        value = seg.builder.normalize(relax.op.reshape(piece, [int(d) for d in m.var.ty.shape]))
        seg.add(relax.VarBinding(m.var, value))


def _collective(name, *args):
    """An impure packed call (R.call_packed): never dropped, never reordered."""
    return relax.Call(relax.ExternFunc(name), list(args),
                      ty_args=[_HANDLE if name.endswith("_start") else _VOID])


def _rewrite(func, world_size, bucket_bytes, overlap, group):
    body = func.body
    if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
        raise ValueError("AllReduceGradients expects train_step with one dataflow block, as "
                         "build_train_step emits it; run it before other block-splitting passes")
    block = body.blocks[0]
    markers = find_markers(block)
    buckets = assign_buckets([m.nbytes for m in markers], bucket_bytes)
    bucket_of = {m.var: b for b, idx in enumerate(buckets) for m in (markers[i] for i in idx)}
    closes_bucket = {markers[idx[-1]].position: b for b, idx in enumerate(buckets)}
    marker_positions = {m.position for m in markers}
    bucket_vars, handles, reduced = {}, {}, set()
    group_arg, avg = relax.prim_value(group), tvm.ir.StringImm("avg")
    seg = _Segments()

    def reduce_before_use(b):
        bucket = bucket_vars[b]
        if overlap:
            seg.bind(f"wait{b}", _collective("raf_dist.ccl.wait", handles[b], bucket), dataflow=False)
        else:
            seg.bind(f"allreduce{b}", _collective("raf_dist.ccl.allreduce", bucket, avg, group_arg,
                                                  bucket), dataflow=False)
        _unflatten_bucket(seg, bucket, [markers[i] for i in buckets[b]])
        reduced.add(b)

    for position, binding in enumerate(block.bindings):
        if position not in marker_positions:
            used = relax.analysis.free_vars(binding.value)
            for b in sorted({bucket_of[v] for v in used if v in bucket_of} - reduced):
                reduce_before_use(b)
            seg.add(binding)
        if position in closes_bucket:
            b = closes_bucket[position]
            bucket_vars[b] = _flatten_bucket(seg, b, [markers[i] for i in buckets[b]])
            if overlap:
                handles[b] = seg.bind(f"handle{b}", _collective(
                    "raf_dist.ccl.allreduce_start", bucket_vars[b], avg, group_arg, bucket_vars[b]),
                    dataflow=False)
    for b in range(len(buckets)):  # gradients nobody reads still get reduced
        if b not in reduced:
            reduce_before_use(b)
    output = body.body
    bound = {b.var: b.value for b in block.bindings}
    result = bound.get(output, output)
    loss = result.fields[0]
    seg.bind("allreduce_loss", _collective("raf_dist.ccl.allreduce", loss, avg, group_arg, loss),
             dataflow=False)
    return _assemble(func, seg.segments, body.body)


def _assemble(func, segments, output):
    """Blocks from segments; dataflow variables used outside their block become Vars."""
    defined_in = {}
    for s, (_, bindings) in enumerate(segments):
        for binding in bindings:
            defined_in[binding.var] = s
    escaping = set()
    for s, (_, bindings) in enumerate(segments):
        for binding in bindings:
            for var in relax.analysis.free_vars(binding.value):
                if defined_in.get(var, s) != s:
                    escaping.add(var)
    escaping |= {v for v in relax.analysis.free_vars(output) if v in defined_in}
    mapping = {v: relax.Var(v.name, v.ty) for v in escaping if isinstance(v, relax.DataflowVar)}
    substitute = SubstituteVars(mapping)
    blocks = []
    for kind, bindings in segments:
        if not bindings:
            continue
        new_bindings = [relax.VarBinding(mapping.get(b.var, b.var), substitute.visit_expr(b.value))
                        for b in bindings]
        blocks.append((relax.DataflowBlock if kind == "dataflow" else relax.BindingBlock)(new_bindings))
    new_body = relax.SeqExpr(blocks, substitute.visit_expr(output))
    return relax.Function(func.params, new_body, func.ret_ty, is_pure=False, attrs=func.attrs)


@tvm.transform.module_pass(opt_level=0, name="AllReduceGradients")
class AllReduceGradients:
    """See the module docstring."""

    def __init__(self, world_size, bucket_bytes, overlap=True, group=0, func_name="train_step"):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.world_size = int(world_size)
        self.bucket_bytes = int(bucket_bytes)
        self.overlap = bool(overlap)
        self.group = int(group)
        self.func_name = func_name

    def transform_module(self, mod, ctx):
        if self.world_size == 1:
            return StripGradientMarkers()(mod)
        func = _rewrite(mod[self.func_name], self.world_size, self.bucket_bytes, self.overlap,
                        self.group)
        mod = mod.__class__(dict(mod.functions_items()))
        mod[self.func_name] = func
        return relax.transform.Normalize()(mod)  # fills in the new blocks' types
