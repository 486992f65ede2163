"""Checkpoints: atomic checksummed files, DCP shards, and the checkpointer over named parts."""

from fastdist.checkpoint.checkpointer import (
    GATHERED,
    PER_RANK,
    REPLICATED,
    SHARDED,
    Checkpointer,
    Resumed,
    Stateful,
)
from fastdist.checkpoint.files import atomic_save, load_checkpoint
from fastdist.checkpoint.rng import RandomState

__all__ = [
    "GATHERED",
    "PER_RANK",
    "REPLICATED",
    "SHARDED",
    "Checkpointer",
    "RandomState",
    "Resumed",
    "Stateful",
    "atomic_save",
    "load_checkpoint",
]
