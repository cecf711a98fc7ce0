"""The one loop every rewriting pass here shares: run a PyExprMutator over each Relax function
of a module and return the rewritten module."""
from tvm import relax


def mutate_functions(mod, mutator):
    """``mutator`` was constructed on ``mod``; its builder collects the rewritten functions."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()
