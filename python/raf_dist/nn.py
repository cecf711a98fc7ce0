"""``raf_dist.nn``: TVM's ``relax.frontend.nn`` module API, re-exported, so models can be
written without PyTorch and trained through the same Trainer path (see
``raf_dist.frontend.from_relax_nn``)."""
from tvm.relax.frontend.nn import *  # noqa: F401,F403
from tvm.relax.frontend.nn import Module, Parameter, spec  # noqa: F401
