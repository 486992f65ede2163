"""Loggers: backends that write a run's record (``DistTrainer(loggers=[...])``) and
:class:`RunLog`, the one component that decides when and what they write."""

from fastdist.loggers.backend import Logger, RunContext
from fastdist.loggers.fitlog import FitlogLogger
from fastdist.loggers.json_lines import JsonLogger
from fastdist.loggers.mlflow import MLflowLogger
from fastdist.loggers.recorder import RunLog
from fastdist.loggers.tensorboard import TensorBoardLogger
from fastdist.loggers.wandb import WandbLogger

__all__ = [
    "FitlogLogger",
    "JsonLogger",
    "Logger",
    "MLflowLogger",
    "RunContext",
    "RunLog",
    "TensorBoardLogger",
    "WandbLogger",
]
