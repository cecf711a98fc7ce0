"""``pipeline_split(x)``: a pipeline stage boundary written in a PyTorch model.

    class Net(nn.Module):
        def forward(self, x):
            x = self.block1(x)
            x = raf_dist.frontend.pipeline_split(x)   # stage 1 starts here
            return self.head(self.block2(x))

It is the custom operator ``raf::stage_boundary`` (torch.library): the identity in PyTorch
(forward and backward, so the module trains there unchanged), kept by torch.export as one
node, and converted by ``from_pytorch`` into raf_dist's stage marker
(``ir.ops.stage_boundary``), where the pipeline partitioner cuts. Without
pipelining the marker is removed. torch.distributed.pipelining's ``pipe_split`` does not
survive TVM's importer (``_pipe_split.default`` is unknown to it), hence an op of our own.
"""
import torch

from ..ir.ops import stage_boundary


@torch.library.custom_op("raf::stage_boundary", mutates_args=())
def _stage_boundary(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_stage_boundary.register_fake
def _(x):
    return torch.empty_like(x)


_stage_boundary.register_autograd(lambda ctx, grad: grad)


def pipeline_split(x):
    """``x``, marked as the input of the next pipeline stage."""
    return _stage_boundary(x)


def _convert(node, importer):
    return importer.block_builder.emit(stage_boundary(importer.env[node.args[0]]))


CONVERTERS = {"stage_boundary.default": _convert}
