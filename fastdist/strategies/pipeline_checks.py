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
from fastdist.strategies.stages import StagePlan, TooFewBlocks, plan_stages

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


def spelled(stages: int, schedule: str, stage_strategy: Any) -> str:
    """``Pipeline(...)`` as a user writes it with these options (the stage strategy's own
    options shortened to its ``tp``)."""
    parts = [f"stages={stages}"]
    if schedule != "1f1b":
        parts.append(f"schedule={schedule!r}")
    if stage_strategy is not None:
        tp = getattr(stage_strategy, "tp", 1)
        inner = f"tp={tp}, ..." if tp > 1 else ""
        parts.append(f"stage_strategy={type(stage_strategy).__name__}({inner})")
    return f"Pipeline({', '.join(parts)})"


def fitting(
    world_size: int | None, schedule: str, stage_strategy: Any, blocks: int | None = None
) -> list[str]:
    """Up to 3 spellings of ``Pipeline`` under ``schedule`` that fit ``world_size`` ranks
    (``None``: any) and a model of ``blocks`` blocks (``None``: any): with the stage strategy
    given, then with smaller ``tp`` (divisors of it), then with DDP stages."""
    per_rank = LOOPED if schedule == "interleaved-1f1b" else 1
    tp = stage_strategy.tp if isinstance(stage_strategy, FSDP) else 1
    kinds = [(stage_strategy, tp)] + [(FSDP(tp=t), t) for t in range(tp - 1, 1, -1) if tp % t == 0]
    kinds += [(None, 1)] if tp > 1 else []
    most = world_size or blocks or 2
    found = [
        spelled(n, schedule, strategy)
        for strategy, t in kinds
        for n in range(2, most + 1)
        if (world_size is None or world_size % (n * t) == 0)
        and (blocks is None or n * per_rank <= blocks)
    ]
    return list(dict.fromkeys(found))[:3]


def stage_plan(model: nn.Module, pipeline: Any, world_size: int | None) -> StagePlan:
    """``model``'s stages under ``pipeline`` (a ``Pipeline``:
    :func:`~fastdist.strategies.stages.plan_stages`); a model of fewer blocks than stages
    refused naming the spellings that fit it, the schedule and ``world_size`` ranks
    (``None``: any), or ``DDP()``/``FSDP()`` when none does."""
    stages, schedule, stage_strategy = pipeline.stages, pipeline.schedule, pipeline.stage_strategy
    per_rank = LOOPED if schedule == "interleaved-1f1b" else 1
    try:
        return plan_stages(model, stages * per_rank, pipeline.split)
    except TooFewBlocks as exc:
        fit = fitting(world_size, schedule, stage_strategy, exc.blocks)
        if not fit and per_rank > 1:  # one stage per rank needs half the blocks
            fit = fitting(world_size, "1f1b", stage_strategy, exc.blocks)
        ranks = "" if world_size is None else f" on {world_size} process(es)"
        fix = f"use {' or '.join(fit)}" if fit else f"no Pipeline fits{ranks}: use DDP() or FSDP()"
        looped = " (2 per rank under interleaved 1F1B)" if per_rank > 1 else ""
        given = spelled(stages, schedule, stage_strategy)
        raise ValueError(
            f"{given} cuts the model into {stages * per_rank} stages{looped}: {exc}: {fix}"
        ) from None


def pipeline_degrees(
    world_size: int, stages: int, schedule: str, stage_strategy: Any
) -> dict[str, int]:
    """``pp x dp_replicate`` (DDP stages), ``pp x dp_shard [x tp]`` (FSDP stages) of
    ``world_size`` ranks; raise a ``ValueError`` naming the spellings that fit if it does
    not divide."""
    tp = stage_strategy.tp if isinstance(stage_strategy, FSDP) else 1
    per = stages * tp
    if world_size % per:
        fit = fitting(world_size, schedule, stage_strategy)
        fits = (
            f", or use {' or '.join(fit)}, which fit{'s' if len(fit) == 1 else ''} {world_size}"
            if fit
            else f"; no Pipeline fits {world_size} process(es): use DDP() or FSDP() there"
        )
        given = spelled(stages, schedule, stage_strategy)
        what = (
            f"runs one stage per rank, but the world has {world_size} process(es), not a "
            f"multiple of {stages}: launch a multiple of {stages} processes"
            if tp == 1
            else f"runs each stage on {tp} tensor-parallel ranks, {per} ranks per pipeline, "
            f"but the world has {world_size} process(es), not a multiple of {per}: launch a "
            f"multiple of {per} processes"
        )
        raise ValueError(f"{given} {what}{fits}")
    if not isinstance(stage_strategy, FSDP):
        return {"pp": stages, "dp_replicate": world_size // per}
    degrees = {"pp": stages, "dp_shard": world_size // per}
    return degrees | ({"tp": tp} if tp > 1 else {})


def check_window(stages: int, schedule: str, stage_strategy: Any, update_every: int) -> None:
    """Refuse updates of ``update_every`` micro-batches that the schedule cannot run (the
    trainer's and the memory estimate's check)."""
    if schedule != "gpipe" and update_every < stages:
        gpipe = spelled(stages, "gpipe", stage_strategy)
        raise ValueError(
            f"schedule={schedule!r} needs at least as many micro-batches per update as "
            f"stages, but update_every={update_every} < stages={stages}: raise update_every "
            f"to {stages}, or use {gpipe}"
        )


def check_setup_options(compile: bool, checkpointing: int) -> None:
    """Refuse the trainer's options a pipeline does not take yet, by name."""
    if compile:
        raise ValueError("compile=True under Pipeline is not supported yet: drop compile")
    if checkpointing:
        raise ValueError(
            "activation_checkpointing under Pipeline is not supported yet (the stages are cut "
            "from the blocks it would wrap): drop activation_checkpointing"
        )


def check_amp(amp: str | None, checkpointing: int = 0) -> None:
    """Refuse ``amp='fp16'`` and activation checkpointing under a pipeline."""
    if amp == "fp16":
        raise ValueError(
            "amp='fp16' under Pipeline: the gradient scaler would skip an update on one "
            "stage only; use amp='bf16'"
        )
    check_setup_options(False, checkpointing)


def check_split(split: Any, stages: int, per_rank: int) -> None:
    """Raise unless ``split`` (``Pipeline``'s) is ``None`` or names where each stage after the
    first starts."""
    if split is None:
        return
    if not isinstance(split, (list, tuple)) or not all(isinstance(s, str) for s in split):
        raise TypeError(f"split must be a list of module names or None, got {split!r}")
    if len(split) != stages * per_rank - 1:
        raise ValueError(
            f"split names where each stage after the first starts: {stages * per_rank - 1} "
            f"name(s) for stages={stages} ({per_rank} per rank), got {len(split)}: {list(split)}"
        )


def check_stage_strategy(strategy: Any) -> None:
    """Raise unless ``strategy`` is one a stage can run under (``None``: DDP())."""
    plain = type(strategy) is DDP and not strategy.comm_hook and not strategy.average_every
    sharded = type(strategy) is FSDP and strategy.replicate == 1 and not callable(strategy.tp_plan)
    sharded = sharded and not strategy.cpu_offload and not strategy.wrap
    if strategy is None or ((plain or sharded) and not strategy.fault_tolerant):
        return
    raise ValueError(
        f"stage_strategy must be DDP() (optionally with bucket_cap_mb, find_unused_parameters, "
        f"static_graph, gradient_as_bucket_view), FSDP() (optionally with "
        f"reshard_after_forward, tp and a dict tp_plan) or None, got {describe(strategy)}: "
        "DDP's communication hooks, local SGD, HSDP (replicate), CPU offload, FSDP's wrap (a "
        "stage shards its blocks and the modules around them), a tp_plan function (it would "
        "split every stage's modules) and fault_tolerant (torchft's replica groups) are not "
        "supported under Pipeline yet; e.g. "
        "Pipeline(stages=2, stage_strategy=FSDP()) or Pipeline(stages=2, "
        "stage_strategy=FSDP(tp=2, tp_plan={'blocks.*.fc': 'colwise', ...}))"
    )


def check_shardable(model: nn.Module, plan: StagePlan) -> None:
    """FSDP stages: every parameter in a module that a stage shards (a block or a module
    around the blocks), none of the model itself."""
    units = [unit for index in range(len(plan.blocks)) for unit in plan.units(index)]
    loose = [n for n, _ in model.named_parameters() if not n.startswith(tuple(units))]
    if loose:
        raise ValueError(
            f"FSDP stages shard the blocks and the modules around them, but {loose} belong to "
            "none: hold them in a submodule (e.g. an nn.Embedding)"
        )


def stage_tp_plans(model: nn.Module, tp_plan: Any, plan: StagePlan) -> list[dict[str, Any]]:
    """``FSDP(tp>1)`` stages: the tensor-parallel plan (resolved on ``model``) cut by stage,
    each stage splitting only its own modules. Raise a ``ValueError`` naming the fix if a
    planned module holds parameters of several stages."""
    from fastdist.strategies.tensor_parallel import resolve_plan

    plans: list[dict[str, Any]] = [{} for _ in plan.blocks]
    resolved = resolve_plan(model, tp_plan)
    assert not callable(resolved), "check_stage_strategy refuses a tp_plan function"
    for name, style in resolved.items():
        params = [f"{name}.{p}" for p, _ in model.get_submodule(name).named_parameters()]
        owners = sorted({plan.owner(p) for p in params or [name + "."]})
        if len(owners) > 1:
            raise ValueError(
                f"tp_plan names {name}, whose parameters lie in pipeline stages {owners}: a "
                "stage splits only its own modules; plan modules inside the blocks (e.g. "
                "'blocks.*.fc') or the modules around them"
            )
        plans[owners[0]][name] = style
    return plans


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
    micro-batches whose activations it holds at once (:func:`kept_micro_batches`)."""
    names = [name for name, _ in model.named_parameters()]
    return [
        MemoryShare(
            label=f"stage {rank}" if ranks == len(plan.blocks) else f"pp rank {rank}",
            trains=frozenset(n for n in names if plan.owner(n) % ranks == rank),
            blocks=tuple(b for s in range(rank, len(plan.blocks), ranks) for b in plan.blocks[s]),
            first=rank == 0,
            last=rank == ranks - 1,
            kept=kept_micro_batches(schedule, update_every, ranks, len(plan.blocks), rank),
        )
        for rank in range(ranks)
    ]


def kept_micro_batches(schedule: str, n: int, ranks: int, stages: int, rank: int) -> float:
    """How many micro-batches' activations (of all its stages) rank ``rank`` holds at once in
    an update of ``n``, as torch's schedule orders them: GPipe (and looped GPipe) all ``n``;
    1F1B ``ranks - rank``; interleaved 1F1B its warm-up forwards plus one, each of one of its
    ``stages / ranks`` stages (torch's ``_get_warmup_ops``): more than 1F1B, for a smaller
    bubble."""
    per_rank = stages // ranks
    kind = schedule_class(schedule, n, ranks, per_rank)
    if kind in (SCHEDULES["gpipe"], SCHEDULES["looped-gpipe"]):
        return n
    if per_rank == 1:
        return min(ranks - rank, n)
    per_round = n // max(1, n // ranks)
    warmup = min((per_rank - 1) * per_round + 2 * (ranks - 1 - rank), n * per_rank)
    return min(warmup + 1, n * per_rank) / per_rank
