"""Moving batches to the device, feeding them to the model and reading named fields."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


def to_device(batch: Any, device: torch.device) -> Any:
    """Copy every tensor in a (nested) dict, list or tuple batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def make_forward(model: nn.Module) -> Callable[[nn.Module, Any], Any]:
    """Return ``forward(module, batch)`` that feeds a batch the way ``model`` expects it.

    Dict batches go in as keyword arguments matched to the parameters of ``model.forward``
    (all fields if it takes ``**kwargs``); tuple batches ``(x, ..., y)`` as ``module(x, ...)``;
    a bare tensor as ``module(x)``.
    """
    params = inspect.signature(model.forward).parameters.values()
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def forward(module: nn.Module, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return module(**(batch if takes_all else {k: batch[k] for k in names & batch.keys()}))
        if isinstance(batch, (list, tuple)):
            return module(*batch[:-1]) if len(batch) > 1 else module(batch[0])
        return module(batch)

    return forward
