"""A sharded model and its optimizer as checkpoint parts (DCP state dicts), and whole copies.

torch's ``torch.distributed.checkpoint.state_dict`` functions do the work: they give each
rank's shards as DTensors for DCP to write and reshard, and gather or scatter a full copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
from torch.distributed.tensor import DTensor

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
        return optimizer_shards(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_optimizer_shards(self.model, self.optimizer, state)


#: Whether the optimizer had stepped when its shards were taken (a key of their state dict).
STEPPED = "stepped"


def optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict``, and whether the optimizer had stepped. For one
    that had not, torch makes the state by stepping it once at learning rate 0, which counts
    as a step for Adam's bias correction: that state is taken, then dropped from the
    optimizer, which stays as it was (and loads so, :func:`load_optimizer_shards`)."""
    stepped = bool(optimizer.state)
    state = get_optimizer_state_dict(model, optimizer)
    if not stepped:
        optimizer.state.clear()
    return {**state, STEPPED: stepped}


def load_optimizer_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load what :func:`optimizer_shards` gave (an optimizer that had not stepped: none)."""
    state = dict(state)
    stepped = state.pop(STEPPED)
    set_optimizer_state_dict(model, optimizer, state)
    if not stepped:
        optimizer.state.clear()


def gather_full(model: nn.Module, rank: int) -> dict[str, Any] | None:
    """The whole model's ``state_dict`` on rank 0's CPU, ``None`` elsewhere (a collective)."""
    weights = get_model_state_dict(model, options=FULL)
    return weights if rank == 0 else None


def scatter_full(model: nn.Module, weights: dict[str, Any] | None) -> None:
    """Load rank 0's whole ``weights`` into every rank's shards (a collective)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights or {}, options=options)


def refuse_sharded_save_pretrained(model: nn.Module) -> None:
    """Make a sharded transformers model's ``save_pretrained`` (and ``push_to_hub``, which
    calls it) raise at once, on the rank that calls it, where it would gather the shards.

    transformers gathers them with a collective: called under ``if rank == 0`` it waits for
    ranks that never join (a hang), called on every rank it fails inside transformers.
    ``trainer.save_model(dir, format="hf")`` gathers with every rank and writes the same
    folder. Given a full ``state_dict`` (no DTensor), ``save_pretrained`` reads nothing
    sharded and runs as it is (``save_model`` calls it so).
    """
    for module in model.modules():  # the model and its transformers submodules
        if callable(getattr(module, "save_pretrained", None)):
            _guard_save_pretrained(module)


def _guard_save_pretrained(model: nn.Module) -> None:
    """Replace ``model.save_pretrained`` by one that refuses sharded weights."""
    save_pretrained: Callable[..., Any] = model.save_pretrained  # type: ignore[assignment]

    @functools.wraps(save_pretrained)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        weights = kwargs.get("state_dict", args[2] if len(args) > 2 else None)
        if weights is None or any(isinstance(v, DTensor) for v in weights.values()):
            raise RuntimeError(
                f"{type(model).__name__}.save_pretrained() cannot gather the weights FSDP "
                "sharded over the ranks (a collective: under `if rank == 0` it would wait "
                'for the other ranks forever): call trainer.save_model(dir, format="hf") on '
                "every rank instead; rank 0 writes the folder save_pretrained would"
            )
        return save_pretrained(*args, **kwargs)

    model.save_pretrained = guarded  # type: ignore[assignment]  # hides the class method
