"""What ``raf_dist.checkpoint`` reads of an executor whose ranks hold pieces of the model."""
import dataclasses
from typing import Any, Dict

from ..training.tensor_parallel import trained_names


class CheckpointView:
    """What ``raf_dist.checkpoint`` reads of a Trainer whose ranks hold pieces of the model
    (tensor parallelism, pipeline stages): the full model (true shapes, every parameter),
    held as by a data-parallel world of every rank without ZeRO. The files are then those of
    any other layout (ranges of the full flat tensors, one file per rank), so a checkpoint
    saved at tp x dp x pp reloads at any layout and the other way round. Saving gathers each
    full tensor on every rank (over tp, pp, and dp under ZeRO) and writes this rank's range of
    it; loading reads the full tensors and the trainer keeps its pieces. ``frozen_full``:
    the full frozen parameters when saving ({} when loading: not read)."""

    def __init__(self, trainer: Any, frozen_full: Dict[str, Any]) -> None:
        model = trainer.full_model
        specs = dict(zip(model.param_names, model.param_specs()))
        names = trained_names(model)
        frozen = [n for n in model.param_names if n not in set(names)]
        self.comm = trainer.comm
        self.data_parallel, self.world, self.zero_level = True, trainer.comm.size, 0
        self.step_count, self.seed = trainer.step_count, trainer.seed
        self.config, self.loss, self.optimizer = trainer.config, trainer.loss, trainer.optimizer
        self.model = model
        self.signature = dataclasses.replace(
            trainer.signature, param_names=names, param_specs=[specs[n] for n in names],
            frozen_names=frozen, frozen_specs=[specs[n] for n in frozen])
        self._frozen = [frozen_full.get(n) for n in frozen]
