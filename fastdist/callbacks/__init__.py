"""Callbacks: subclass :class:`Callback`, or use the built-ins."""

from fastdist.callbacks.callback import Callback, CallbackList
from fastdist.callbacks.early_stop import EarlyStopCallback
from fastdist.callbacks.fitlog import FitlogCallback
from fastdist.callbacks.gradient_clip import GradientClipCallback
from fastdist.callbacks.json_log import JSONLogCallback
from fastdist.callbacks.lr_scheduler import LRSchedulerCallback
from fastdist.callbacks.profiler import ProfilerCallback
from fastdist.callbacks.run_log import RunLogCallback
from fastdist.callbacks.tensorboard import TensorBoardCallback
from fastdist.callbacks.warmup import WarmupCallback

__all__ = [
    "Callback",
    "CallbackList",
    "EarlyStopCallback",
    "FitlogCallback",
    "GradientClipCallback",
    "JSONLogCallback",
    "LRSchedulerCallback",
    "ProfilerCallback",
    "RunLogCallback",
    "TensorBoardCallback",
    "WarmupCallback",
]
