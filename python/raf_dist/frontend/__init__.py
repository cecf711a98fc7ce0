"""Frontends: capture a model into a Relax ``forward`` function (a :class:`raf_dist.model.Model`)."""
from .pipeline_split import pipeline_split
from .pytorch import from_pytorch
from .relax_nn import from_relax_nn

__all__ = ["from_pytorch", "from_relax_nn", "pipeline_split"]
