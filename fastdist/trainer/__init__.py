"""The trainer: the ``DistTrainer`` facade, its options, assembly and loop."""

from fastdist.trainer.dist_trainer import DistTrainer
from fastdist.trainer.options import TrainerOptions

__all__ = ["DistTrainer", "TrainerOptions"]
