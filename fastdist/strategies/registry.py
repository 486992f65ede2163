"""Strategies by name, and how to run (or name) a module that is wrapped or sharded."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fastdist.distributed.dtensor import is_fsdp_module
from fastdist.strategies.base import Strategy
from fastdist.strategies.ddp import DDP
from fastdist.strategies.fsdp import FSDP

#: ``strategy="ddp"`` and ``strategy="fsdp"``: the strategies with their default options.
BY_NAME: dict[str, type[Strategy]] = {"ddp": DDP, "fsdp": FSDP}


def resolve_strategy(strategy: Any) -> Strategy:
    """The strategy object of ``DistTrainer(strategy=...)``: a name means the defaults; an
    object is copied, so that one object may configure several trainers."""
    if isinstance(strategy, Strategy):
        return copy.copy(strategy)
    if isinstance(strategy, str) and strategy in BY_NAME:
        return BY_NAME[strategy]()
    raise ValueError(
        f"strategy must be 'ddp' (every rank holds the whole model), 'fsdp' (sharded "
        f"parameters, gradients and optimizer state) or an object of fastdist.strategies "
        f"(DDP(...), FSDP(...), Pipeline(...)), got {strategy!r}"
    )


def eval_view(model: nn.Module) -> tuple[nn.Module, bool]:
    """``(module to run, whether every rank must run equally many forwards)`` for a model
    given as it is, possibly wrapped by DDP or sharded by FSDP, whole or in parts (a
    pipeline's stage: each forward a collective; fastdist's tensor-parallel models are
    sharded too)."""
    if isinstance(model, DistributedDataParallel):
        return model.module, False
    return model, any(is_fsdp_module(module) for module in model.modules())


def model_class(model: nn.Module) -> type[nn.Module]:
    """The user's class of ``model``: a DDP wrapper's module's; FSDP's ``fully_shard`` swaps
    a model's class in place for a subclass named ``FSDP<Name>``, whose base it is."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    if not is_fsdp_module(model):
        return type(model)
    from torch.distributed.fsdp import FSDPModule

    return next(
        c for c in type(model).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule)
    )
