"""What the distribution passes share: bucket assignment, building a new function body as
alternating dataflow / impure segments, and the impure collective calls that anchor it."""
import tvm
from tvm import relax

from .gradient_markers import SubstituteVars

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


BUCKET_ALIGN_BYTES = 64  # generated kernels assume 64-byte aligned data (misaligned: SIGSEGV)


def bucket_layout(numels, elem_bytes):
    """Element offsets of tensors placed back to back in one bucket, each starting on a
    BUCKET_ALIGN_BYTES boundary so the kernel that computes a gradient can write it in place,
    and the bucket's total element count (no padding after the last tensor)."""
    align = max(1, BUCKET_ALIGN_BYTES // elem_bytes)
    offsets, end = [], 0
    for n in numels:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + n
    return offsets, end


def marker_buckets(markers, bucket_bytes, groups=None):
    """Parameter indices per gradient bucket, from gradient markers in backward order
    (``bucket_runs``'s buckets)."""
    return [[markers[i].param_index for i in idx]
            for idx in bucket_runs(markers, bucket_bytes, groups)]


def bucket_runs(markers, bucket_bytes, groups=None):
    """Marker indices per gradient bucket, from gradient markers in backward order.
    ``groups`` (the optimizer parameter group of each parameter, ``raf_dist.update_groups``):
    a bucket holds one group's gradients (ZeRO updates a bucket with one update chain), so a
    bucket also closes where backward moves on to another group's gradient."""
    runs = [[0]] if markers else []
    for i in range(1, len(markers)):
        same = groups is None or (groups[markers[i].param_index]
                                  == groups[markers[i - 1].param_index])
        if same:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [[run[i] for i in idx] for run in runs
            for idx in assign_buckets([markers[i].nbytes for i in run], bucket_bytes)]


def update_groups(func):
    """``raf_dist.update_groups`` of a step function, or None (one group)."""
    from ..ir.attrs import UPDATE_GROUPS
    attrs = func.attrs
    if attrs is None or UPDATE_GROUPS not in attrs:
        return None
    return [int(g) for g in attrs[UPDATE_GROUPS]]


def gradient_buckets(mod, bucket_bytes, func_name="train_step"):
    """Parameter indices per gradient bucket, in the order backward produces them: what
    AllReduceGradients and ShardZeRO reduce together."""
    from .gradient_markers import find_markers
    func = mod[func_name]
    return marker_buckets(find_markers(func.body.blocks[0]), bucket_bytes, update_groups(func))


class Segments:
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


def collective(name, *args):
    """An impure packed call (R.call_packed): never dropped, never reordered."""
    return relax.Call(relax.ExternFunc(name), list(args),
                      ty_args=[_HANDLE if name.endswith("_start") else _VOID])


def assemble(func, segments, output, params=None, ret_ty=None):
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
    return relax.Function(func.params if params is None else params, new_body,
                          func.ret_ty if ret_ty is None else ret_ty, is_pure=False,
                          attrs=func.attrs)
