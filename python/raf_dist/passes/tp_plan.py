"""The tensor-parallel plan as data (DESIGN.md 3b): which parameters are split, along which
dimension and in how many segments (``Placement``), why the others stay whole, the
collectives a step holds, a padded vocabulary (tp_padding.py); and what it implies for a
parameter: a tp rank's piece (``local_shard``, ``local_shape``), the whole from the pieces
(``assemble``), the plan as text (``explain``).

``plan_tensor_parallel`` (tensor_parallel.py) finds the plan; ``shard_forward``
(tp_shard.py) applies it to the forward.
"""
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Placement:
    """Parameter split along ``dim`` into ``T`` parts within each of ``segments`` segments."""

    dim: int
    segments: int
    role: str  # "colwise" (output features), "rowwise" (input features), "bias", "split"


@dataclasses.dataclass
class TensorParallelPlan:
    tp: int
    placements: dict  # param name -> Placement
    replicated: dict  # param name -> why it stays whole
    shapes: dict  # param name -> full shape
    forward_reduces: list  # numel of each g in the forward
    backward_reduces: list  # numel of each f whose input needs a gradient
    # the output (logits) stays split along its classes: vocabulary-parallel cross-entropy,
    # whose allreduces (max, sum of exponentials, target logit: one value per row) these are
    output_split: bool = False
    loss_reduces: list = dataclasses.field(default_factory=list)
    # a vocabulary T does not divide, padded to a multiple of T (tp_padding.py):
    # {param name: Padding}; the classes of the output (those of the full model: predict's)
    padding: dict = dataclasses.field(default_factory=dict)
    output_classes: int = 0

    def padded_shape(self, name):
        """The shape the tp ranks hold ``name`` in, together: its full shape, padded."""
        shape, pad = list(self.shapes[name]), self.padding.get(name)
        if pad is not None:
            shape[pad.dim] = pad.padded
        return tuple(shape)

    def local_shard(self, name, array, rank):
        """This tp rank's piece of parameter ``name`` (the whole array when replicated; a
        padded one's padding is zeros)."""
        p = self.placements.get(name)
        if p is None:
            return array
        pad = self.padding.get(name)
        if pad is not None:
            widths = [(0, 0)] * array.ndim
            widths[pad.dim] = (0, pad.padded - array.shape[pad.dim])
            array = np.pad(array, widths)
        shape = array.shape
        seg = array.reshape(shape[:p.dim] + (p.segments, self.tp,
                                              shape[p.dim] // p.segments // self.tp)
                            + shape[p.dim + 1:])
        piece = seg.take(rank, axis=p.dim + 1)
        return piece.reshape(shape[:p.dim] + (shape[p.dim] // self.tp,) + shape[p.dim + 1:])

    def local_shape(self, name, shape):
        """The shape of this tp rank's piece of parameter ``name`` of ``shape`` (what
        local_shard returns, without computing it)."""
        shape = list(shape)
        p = self.placements.get(name)
        if p is None:
            return tuple(shape)
        pad = self.padding.get(name)
        if pad is not None:
            shape[pad.dim] = pad.padded
        shape[p.dim] //= self.tp
        return tuple(shape)

    def assemble(self, name, pieces):
        """The full parameter from every tp rank's piece, in tp-rank order."""
        p = self.placements.get(name)
        if p is None:
            return pieces[0]
        shape = pieces[0].shape
        split = [q.reshape(shape[:p.dim] + (p.segments, 1, shape[p.dim] // p.segments)
                           + shape[p.dim + 1:]) for q in pieces]
        full = np.concatenate(split, axis=p.dim + 1).reshape(self.padded_shape(name))
        pad = self.padding.get(name)
        if pad is not None:  # the padded rows are no part of the model
            full = full[(slice(None),) * pad.dim + (slice(0, pad.size),)]
        return full

    def explain(self, itemsize=4):
        """The plan as text: each parameter's placement (or why it is replicated) and the
        collectives per step with their bytes."""
        lines = [f"tensor parallel plan, T = {self.tp}"]
        width = max((len(n) for n in self.shapes), default=10)
        for name, shape in self.shapes.items():
            p = self.placements.get(name)
            what = (f"{p.role:8s} split dim {p.dim}" + (f" ({p.segments} segments)"
                                                        if p.segments > 1 else "")
                    if p else f"replicated: {self.replicated.get(name, '')}")
            pad = self.padding.get(name)
            if pad is not None:
                extra = pad.padded - pad.size
                what += f", padded to {pad.padded} ({extra} zero row{'s' * (extra > 1)})"
            lines.append(f"  {name:{width}s} {str(list(shape)):16s} {what}")
        bus = 2 * (self.tp - 1) / self.tp * itemsize
        for size, padded in sorted({(p.size, p.padded) for p in self.padding.values()}):
            masked = self.output_split and self.output_classes == size
            lines.append(f"  the vocabulary of {size} is padded to {padded}, a multiple of "
                         f"T = {self.tp} ({padded // self.tp} rows per rank; the added rows "
                         "are zeros" + ("; their logits are masked out of the loss and "
                                        "predict" if masked else "")
                         + "); state_dict() and checkpoints keep the true shapes")
        if self.output_split:
            lines.append("  the output stays split along its classes: vocabulary-parallel "
                         "cross-entropy")
        for kind, sizes in (("forward", self.forward_reduces),
                            ("backward", self.backward_reduces), ("loss", self.loss_reduces)):
            if kind == "loss" and not sizes:
                continue
            lines.append(f"  {kind}: {len(sizes)} allreduce(s) over tp, "
                         f"{sum(sizes) * itemsize} bytes, {sum(sizes) * bus:.0f} bus bytes")
        return "\n".join(lines)
