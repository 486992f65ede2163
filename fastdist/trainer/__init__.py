"""The trainer: set-up, loop, evaluation, state."""

from fastdist.trainer.config import TrainerConfig
from fastdist.trainer.dist_trainer import DistTrainer
from fastdist.trainer.evaluator import Evaluator
from fastdist.trainer.state import TrainerState

__all__ = ["DistTrainer", "Evaluator", "TrainerConfig", "TrainerState"]
