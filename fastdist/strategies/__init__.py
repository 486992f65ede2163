"""Parallelism strategies: one module each, one small interface the training loop calls."""

from __future__ import annotations

from typing import Any

import torch

from fastdist.distributed import is_distributed
from fastdist.strategies.base import Strategy
from fastdist.strategies.ddp import DDPStrategy

__all__ = ["DDPStrategy", "Strategy", "make_strategy"]


def make_strategy(
    device: torch.device,
    group: Any,
    ddp_comm_hook: str | None = None,
    average_every: int = 0,
    **ddp_options: Any,
) -> Strategy:
    """The strategy of this run: DDP when several processes train, else the plain model."""
    if not is_distributed():
        return Strategy(device, group)
    if ddp_options.get("bucket_cap_mb") is None:
        ddp_options.pop("bucket_cap_mb", None)
    return DDPStrategy(device, group, ddp_comm_hook, average_every, **ddp_options)
