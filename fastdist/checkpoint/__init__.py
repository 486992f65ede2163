"""Checkpoints: atomic checksummed files, DCP shards, and the checkpointer over named parts."""

from fastdist.checkpoint.checkpointer import (
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
