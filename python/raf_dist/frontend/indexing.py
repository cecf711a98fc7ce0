"""Advanced indexing (``aten.index.Tensor``) that TVM 0.27's importer converts wrongly.

``x[:, rows, cols]`` (DLRM's pick of the pairwise dot products, any gather of matrix entries
by coordinate lists) is ``index.Tensor(x, [None, rows, cols])``: PyTorch broadcasts the index
tensors together and picks one element per position (here a (batch, P) result for P
coordinates). TVM's converter, when some dimension is sliced (a ``None``) and every index is
1-D, takes along each axis in turn: an outer product, (batch, P, P). That is only right when
the index shapes are orthogonal ((H, 1) and (W,)), and otherwise gives a tensor of the wrong
shape, or, when the shapes happen to fit, wrong values.

``index_tensor`` converts those cases (at least two index tensors and at least one sliced
dimension) with ops that have gradients and schedules: the indexed axes are merged into one
(moved together first when a slice separates them), the index tensors become one broadcast
linear index, and ``take`` picks along the merged axis. The result's dimensions are placed by
PyTorch's rule: where the indexed axes were when they are adjacent, first otherwise. Every
other form is left to TVM's converter, which is right for them.
"""
from tvm import relax

op = relax.op


def _is_integer(expr) -> bool:
    return str(expr.ty.dtype).startswith(("int", "uint"))


def index_tensor(node, importer) -> relax.Var:
    """Converter for ``index.Tensor`` (custom_convert_map entry); see the module docstring."""
    args = importer.retrieve_args(node)
    data, indices = args[0], list(args[1])
    given = [(axis, idx) for axis, idx in enumerate(indices) if idx is not None]
    if len(given) < 2 or len(given) == len(indices) or not all(
            isinstance(idx, relax.Expr) and _is_integer(idx) for _, idx in given):
        return importer._index_tensor(node)  # one index, no slice, or masks: TVM's is right
    bb = importer.block_builder
    shape = [int(d) for d in data.ty.shape]
    ndim = len(shape)
    axes = [axis for axis, _ in given]
    if axes == list(range(axes[0], axes[-1] + 1)):  # adjacent: the result dims stay there
        first = axes[0]
    else:  # separated by a slice: PyTorch puts the result dims first
        order = axes + [a for a in range(ndim) if a not in axes]
        data = bb.emit(op.permute_dims(data, order))
        first = 0
    merged = 1
    for axis in axes:
        merged *= shape[axis]
    rest = [shape[a] for a in range(ndim) if a not in axes]
    flat_shape = rest[:first] + [merged] + rest[first:]
    flat = bb.emit(op.reshape(data, flat_shape))
    linear, stride = None, merged
    for axis, idx in given:  # row-major position within the merged axis
        dim = shape[axis]
        stride //= dim
        idx_dtype = str(idx.ty.dtype)
        idx = bb.emit(op.astype(idx, "int64")) if idx_dtype != "int64" else idx
        wrapped = op.where(op.less(idx, relax.const(0, "int64")),
                           op.add(idx, relax.const(dim, "int64")), idx)  # negative: from the end
        term = bb.emit(op.multiply(wrapped, relax.const(stride, "int64")))
        linear = term if linear is None else bb.emit(op.add(linear, term))
    return bb.emit(op.take(flat, linear, axis=first))
