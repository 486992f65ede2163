"""The pipeline's rules that need no process group: which stage strategies it takes, the one
shape of an update's micro-batches, and what each stage trains and keeps (the memory
estimate's question, :meth:`~fastdist.strategies.base.Strategy.memory_shares`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from fastdist.checks import describe
from fastdist.strategies.base import MemoryShare
from fastdist.strategies.ddp import DDP
from fastdist.strategies.fsdp import FSDP
from fastdist.strategies.stages import StagePlan


def check_stage_strategy(strategy: Any) -> None:
    """Raise unless ``strategy`` is one a stage can run under (``None``: DDP())."""
    plain = type(strategy) is DDP and not strategy.comm_hook and not strategy.average_every
    sharded = type(strategy) is FSDP and strategy.tp == strategy.replicate == 1
    if strategy is None or plain or (sharded and not strategy.cpu_offload and not strategy.wrap):
        return
    raise ValueError(
        f"stage_strategy must be DDP() (optionally with bucket_cap_mb, find_unused_parameters, "
        f"static_graph, gradient_as_bucket_view), FSDP() (optionally with "
        f"reshard_after_forward) or None, got {describe(strategy)}: DDP's communication hooks, "
        "local SGD, tensor parallelism, HSDP, CPU offload and FSDP's wrap (a stage shards its "
        "blocks and the modules around them) are not supported under Pipeline yet"
    )


def check_one_shape(sizes: list[list[int]], update_every: int) -> None:
    """Every micro-batch of an update goes through one schedule, so it must have the update's
    shape: refuse an epoch of data shards of batch sizes ``sizes`` (samples) whose short last
    batch would share an update with full ones, naming the fixes."""
    longest = max(map(len, sizes), default=0)
    for shard in sizes:
        padded = shard + shard[-1:] * (longest - len(shard))  # fillers: the last again
        for start in range(0, len(padded), update_every):
            window = padded[start : start + update_every]
            if len(set(window)) > 1:
                raise ValueError(
                    f"Pipeline runs an update's micro-batches through one schedule, so they "
                    f"must have one shape, but an epoch's last update would hold batches of "
                    f"{window} samples (data shards of {sum(shard)} samples, "
                    f"batch_size_per_gpu={max(shard)}, update_every={update_every}): set "
                    f"drop_last=True, a batch_size_per_gpu dividing {sum(shard)}, or an "
                    "update_every that leaves the short batch alone in the last update"
                )


def stage_shares(
    model: nn.Module, plan: StagePlan, schedule: str, update_every: int
) -> list[MemoryShare]:
    """Each stage: its parameters trained (the rest of the model held whole), its blocks run,
    and the micro-batches whose activations it holds at once (GPipe: all of an update's;
    1F1B: ``stages - index`` on stage ``index``)."""
    names = [name for name, _ in model.named_parameters()]
    stages = len(plan.blocks)
    return [
        MemoryShare(
            label=f"stage {index}",
            trains=frozenset(n for n in names if plan.owner(n) == index),
            blocks=tuple(plan.blocks[index]),
            first=index == 0,
            last=index == stages - 1,
            kept=update_every if schedule == "gpipe" else min(stages - index, update_every),
        )
        for index in range(stages)
    ]
