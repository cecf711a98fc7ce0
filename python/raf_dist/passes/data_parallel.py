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

from .bucketing import (Segments, assemble, bucket_layout, bucket_runs, collective,
                        update_groups)
from .gradient_markers import StripGradientMarkers, find_markers


BUCKET_PACK = "raf_dist.bucket.pack"
BUCKET_VIEW = "raf_dist.bucket.view"


def _layout(markers):
    dtypes = {str(m.var.ty.dtype) for m in markers}
    if len(dtypes) != 1:
        raise ValueError(f"a gradient bucket holds one dtype, got {sorted(dtypes)} for parameters "
                         f"{[m.param_index for m in markers]}: give the parameters one dtype")
    dtype = tvm.DataType(dtypes.pop())
    return bucket_layout([m.numel for m in markers], (dtype.bits * dtype.lanes + 7) // 8)


def _flatten_bucket(seg, bucket_id, markers):
    """The bucket: every gradient of it at its aligned offset in one new buffer."""
    offsets, total = _layout(markers)
    ty = relax.TensorType([total], markers[0].var.ty.dtype)
    return seg.bind(f"bucket{bucket_id}", relax.call_pure_packed(
        BUCKET_PACK, *[m.grad for m in markers], relax.ShapeExpr(offsets),
        relax.prim_value(total), ty_args=ty))


def _unflatten_bucket(seg, bucket, markers):
    """Bind each marker's own variable to a zero-copy view of its part of the reduced bucket."""
    offsets, _ = _layout(markers)
    for m, offset in zip(markers, offsets):
        shape = [int(d) for d in m.var.ty.shape]
        value = seg.builder.normalize(relax.call_pure_packed(
            BUCKET_VIEW, bucket, relax.prim_value(offset),
            relax.ShapeExpr(shape), relax.prim_value(0),
            ty_args=m.var.ty))
        seg.add(relax.VarBinding(m.var, value))


def _rewrite(func, world_size, bucket_bytes, overlap, group):
    body = func.body
    if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
        raise ValueError("AllReduceGradients expects train_step with one dataflow block, as "
                         "build_train_step emits it; run it before other block-splitting passes")
    block = body.blocks[0]
    markers = find_markers(block)
    buckets = bucket_runs(markers, bucket_bytes, update_groups(func))
    bucket_of = {m.var: b for b, idx in enumerate(buckets) for m in (markers[i] for i in idx)}
    closes_bucket = {markers[idx[-1]].position: b for b, idx in enumerate(buckets)}
    marker_positions = {m.position for m in markers}
    bucket_vars, handles, reduced = {}, {}, set()
    group_arg, avg = relax.prim_value(group), tvm.ir.StringImm("avg")
    seg = Segments()

    def reduce_before_use(b):
        bucket = bucket_vars[b]
        if overlap:
            seg.bind(f"wait{b}", collective("raf_dist.ccl.wait", handles[b], bucket), dataflow=False)
        else:
            seg.bind(f"allreduce{b}", collective("raf_dist.ccl.allreduce", bucket, avg, group_arg,
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
                handles[b] = seg.bind(f"handle{b}", collective(
                    "raf_dist.ccl.allreduce_start", bucket_vars[b], avg, group_arg, bucket_vars[b]),
                    dataflow=False)
    for b in range(len(buckets)):  # gradients nobody reads still get reduced
        if b not in reduced:
            reduce_before_use(b)
    output = body.body
    bound = {b.var: b.value for b in block.bindings}
    result = bound.get(output, output)
    loss = result.fields[0]
    seg.bind("allreduce_loss", collective("raf_dist.ccl.allreduce", loss, avg, group_arg, loss),
             dataflow=False)
    return assemble(func, seg.segments, body.body)


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
