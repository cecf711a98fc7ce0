"""Small IR utilities the layers share: running a PyExprMutator over each Relax function of a
module, the operator a call calls, recognising the ``call_pure_packed`` markers the frontends and the step builder leave
for passes to rewrite, element counts of static tensor types, a sum of a whole tensor that
runs on every core."""
import tvm
from tvm import relax

_CALL_PURE_PACKED = tvm.ir.Op.get("relax.call_pure_packed")


def is_packed_marker(expr, symbol):
    """True for ``R.call_pure_packed(symbol, ...)``."""
    return (isinstance(expr, relax.Call) and expr.op == _CALL_PURE_PACKED
            and isinstance(expr.args[0], relax.ExternFunc)
            and expr.args[0].global_symbol == symbol)


def mutate_functions(mod, mutator):
    """``mutator`` was constructed on ``mod``; its builder collects the rewritten functions."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def op_name(value) -> str:
    """The name of the operator ``value`` calls ("relax.matmul"); "" when it is not a call
    of an operator (a variable, a constant, a call of a function or a packed function)."""
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return str(value.op.name)
    return ""


def tensor_numel(ty):
    """Element count of a statically shaped TensorType."""
    n = 1
    for d in ty.shape:
        n *= int(d)
    return n


def tensor_nbytes(ty):
    """Bytes of a statically shaped TensorType."""
    return tensor_numel(ty) * tvm.DataType(str(ty.dtype)).bits // 8


#: a reduction this long is split so that it runs on every core (compiler/schedule.py treats
#: a reduction of >= 16384 elements with no data-parallel outer loop as a serial fallback)
_SERIAL_LIMIT = 16384
_CHUNK = 256


def sum_all(bb: relax.BlockBuilder, g: relax.Expr) -> relax.Var:
    """sum(g) as sums of rows of _CHUNK elements (a data-parallel outer loop), repeated until
    what is left is short, then one final sum. Zero padding keeps NaN and inf."""
    op = relax.op
    numel = 1
    for dim in g.ty.shape:
        numel *= int(dim)
    flat = bb.emit(op.reshape(g, (numel,)))
    while numel >= _SERIAL_LIMIT:
        rows = -(-numel // _CHUNK)
        if rows * _CHUNK != numel:
            flat = bb.emit(op.nn.pad(flat, [0, rows * _CHUNK - numel]))
        flat = bb.emit(op.sum(op.reshape(flat, (rows, _CHUNK)), axis=[1]))
        numel = rows
    return bb.emit(op.sum(flat))
