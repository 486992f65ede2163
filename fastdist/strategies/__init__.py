"""Parallelism strategies: one module each, one small interface the training loop calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fastdist.distributed import get_world_size
from fastdist.logging import logger
from fastdist.strategies.base import Strategy
from fastdist.strategies.ddp import DDPStrategy
from fastdist.strategies.fsdp import FSDPStrategy, check_fsdp_wrap
from fastdist.trainer.config import TrainerConfig

__all__ = ["DDPStrategy", "FSDPStrategy", "Strategy", "check_strategy_inputs", "make_strategy"]


def check_strategy_inputs(
    cfg: TrainerConfig,
    model: nn.Module,
    fsdp_wrap: Sequence[type[nn.Module]] | None,
    device: torch.device,
) -> None:
    """What the config cannot check alone; on every rank alike, before any collective."""
    if fsdp_wrap is not None and cfg.strategy != "fsdp":
        raise ValueError("fsdp_wrap is an option of strategy='fsdp'")
    check_fsdp_wrap(model, fsdp_wrap)
    if cfg.cpu_offload and device.type != "cuda":
        raise ValueError(
            "cpu_offload=True moves sharded state from the GPU to host memory; on a CPU "
            "device it already lives there: drop cpu_offload"
        )


def make_strategy(
    cfg: TrainerConfig,
    device: torch.device,
    group: Any,
    fsdp_wrap: Sequence[type[nn.Module]] | None = None,
) -> Strategy:
    """The strategy of this run: ``cfg.strategy`` when several processes train, else none."""
    if get_world_size() == 1:
        if cfg.strategy == "fsdp":
            logger.info("strategy='fsdp' on one process: the plain model, nothing to shard")
        return Strategy(device, group)
    if cfg.strategy == "fsdp":
        return FSDPStrategy(
            device, group, fsdp_wrap, cfg.reshard_after_forward, cfg.amp, cfg.cpu_offload
        )
    ddp_options: dict[str, Any] = {
        "find_unused_parameters": cfg.find_unused_parameters,
        "static_graph": cfg.static_graph,
        "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
    }
    if cfg.bucket_cap_mb is not None:
        ddp_options["bucket_cap_mb"] = cfg.bucket_cap_mb
    return DDPStrategy(device, group, cfg.ddp_comm_hook, cfg.average_every, **ddp_options)
