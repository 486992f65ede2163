"""Parallelism strategies: option objects that wrap the model, one module each.

``DistTrainer(strategy=...)`` takes ``"ddp"`` (the default), ``"fsdp"`` or an object holding
its options, e.g. ``DDP(bucket_cap_mb=50, comm_hook="powersgd")``, ``FSDP(wrap=[Block])`` or
``FSDP(tp=2, tp_plan=...)`` (FSDP with tensor parallelism), ``FSDP(replicate=2)`` (HSDP),
``Pipeline(stages=2, schedule="1f1b")`` (pipeline stages, each replicated with DDP). The
layout they run on is a :class:`Topology` (``trainer.topology``).
"""

from fastdist.strategies.base import MemoryShare, Strategy
from fastdist.strategies.ddp import DDP
from fastdist.strategies.fsdp import FSDP
from fastdist.strategies.pipeline import Pipeline
from fastdist.strategies.registry import eval_view, model_class, resolve_strategy
from fastdist.strategies.topology import DataShard, Topology

__all__ = [
    "DDP",
    "FSDP",
    "DataShard",
    "MemoryShare",
    "Pipeline",
    "Strategy",
    "Topology",
    "eval_view",
    "model_class",
    "resolve_strategy",
]
