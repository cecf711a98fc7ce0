"""Small IR utilities the layers share: running a PyExprMutator over each Relax function of a
module, recognising the ``call_pure_packed`` markers the frontends and the step builder leave
for passes to rewrite, element counts of static tensor types."""
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


def tensor_numel(ty):
    """Element count of a statically shaped TensorType."""
    n = 1
    for d in ty.shape:
        n *= int(d)
    return n
