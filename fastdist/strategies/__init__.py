"""Parallelism strategies: option objects that wrap the model, one module each.

``DistTrainer(strategy=...)`` takes ``"ddp"`` (the default), ``"fsdp"`` or an object holding
its options, e.g. ``DDP(bucket_cap_mb=50, comm_hook="powersgd")`` or ``FSDP(wrap=[Block])``.
"""

from fastdist.strategies.base import Strategy
from fastdist.strategies.ddp import DDP
from fastdist.strategies.fsdp import FSDP
from fastdist.strategies.registry import eval_view, model_class, resolve_strategy

__all__ = ["DDP", "FSDP", "Strategy", "eval_view", "model_class", "resolve_strategy"]
