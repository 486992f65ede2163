"""The pipeline's rules that need no process group: which stage strategies it takes, which
schedule runs an update, the one shape of an update's micro-batches, and what each stage
trains and keeps (the memory estimate's question,
:meth:`~fastdist.strategies.base.Strategy.memory_shares`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from fastdist.checks import describe
from fastdist.strategies.base import MemoryShare
from fastdist.strategies.ddp import DDP
from fastdist.strategies.fsdp import FSDP
from fastdist.strategies.stages import StagePlan

#: torch.distributed.pipelining's schedule classes by name (a looped schedule runs several
#: stages per rank; LoopedBFS is GPipe's).
SCHEDULES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-gpipe": "ScheduleLoopedBFS",
}
#: Stages each rank runs under a looped schedule.
LOOPED = 2


def schedule_class(schedule: str, n: int, ranks: int, per_rank: int) -> str:
    """The class of torch's schedule for updates of ``n`` micro-batches over ``ranks`` ranks
    of ``per_rank`` stages each: (looped) GPipe for fewer micro-batches than ranks, and for
    counts interleaved 1F1B cannot split into rounds of ``ranks``; else ``schedule``'s."""
    rounds = max(1, n // ranks)
    if n < ranks or (per_rank > 1 and n % rounds):
        schedule = "looped-gpipe" if per_rank > 1 else "gpipe"
    return SCHEDULES[schedule]


def check_setup_options(compile: bool, checkpointing: int) -> None:
    """Refuse the trainer's options a pipeline does not take yet, by name."""
    if compile:
        raise ValueError("compile=True under Pipeline is not supported yet: drop compile")
    if checkpointing:
        raise ValueError(
            "activation_checkpointing under Pipeline is not supported yet (the stages are cut "
            "from the blocks it would wrap): drop activation_checkpointing"
        )


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
    model: nn.Module, plan: StagePlan, schedule: str, update_every: int, ranks: int
) -> list[MemoryShare]:
    """Each of the ``ranks`` ranks of a pipeline (stage ``s`` on rank ``s % ranks``): its
    parameters trained (the rest of the model held whole), its blocks run, and the
    micro-batches whose activations it holds at once (GPipe: all of an update's; 1F1B:
    ``ranks - rank`` on rank ``rank``; interleaved, roughly as 1F1B)."""
    names = [name for name, _ in model.named_parameters()]
    return [
        MemoryShare(
            label=f"stage {rank}" if ranks == len(plan.blocks) else f"pp rank {rank}",
            trains=frozenset(n for n in names if plan.owner(n) % ranks == rank),
            blocks=tuple(b for s in range(rank, len(plan.blocks), ranks) for b in plan.blocks[s]),
            first=rank == 0,
            last=rank == ranks - 1,
            kept=update_every if schedule == "gpipe" else min(ranks - rank, update_every),
        )
        for rank in range(ranks)
    ]
