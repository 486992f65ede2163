"""A sharded model and its optimizer as checkpoint parts (DCP state dicts), and whole copies.

torch's ``torch.distributed.checkpoint.state_dict`` functions do the work: they give each
rank's shards as DTensors for DCP to write and reshard, and gather or scatter a full copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

#: A whole copy, gathered to the CPU.
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class ShardedModel:
    """The model's state as this rank's shards (a sharded checkpoint part)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class ShardedOptimizer:
    """The optimizer's state as this rank's shards, keyed by parameter name."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


def gather_full(model: nn.Module, rank: int) -> dict[str, Any] | None:
    """The whole model's ``state_dict`` on rank 0's CPU, ``None`` elsewhere (a collective)."""
    weights = get_model_state_dict(model, options=FULL)
    return weights if rank == 0 else None


def scatter_full(model: nn.Module, weights: dict[str, Any] | None) -> None:
    """Load rank 0's whole ``weights`` into every rank's shards (a collective)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights or {}, options=options)
