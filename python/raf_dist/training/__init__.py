"""Training-step construction: loss, autodiff, optimizer update — one Relax function."""
from .loss import LOSSES, build_loss
from .step import TrainStepSignature, build_train_step

__all__ = ["LOSSES", "TrainStepSignature", "build_loss", "build_train_step"]
