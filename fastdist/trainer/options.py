"""The trainer's options as one typed, validated, frozen object.

:class:`~fastdist.DistTrainer` documents every option; this object holds the ones that are
values rather than parts (data, model, optimizer, loss, metrics, callbacks, samplers are
checked in :mod:`fastdist.trainer.arguments`). Validation runs before the process group
starts, on every rank alike, so bad input fails the same way everywhere and never leaves a
rank waiting in a collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from fastdist.checkpoint.export import FORMATS
from fastdist.checks import (
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_number,
    check_path,
    describe,
)
from fastdist.data.workers import CONTEXTS
from fastdist.distributed import get_world_size
from fastdist.strategies import Strategy, resolve_strategy
from fastdist.strategies.blocks import checkpoint_period
from fastdist.strategies.replica_groups import GROUPS_VAR

#: The longest ``timeout`` (seconds): torch fails late on infinity or 1e30.
MAX_TIMEOUT_S = 1e8


@dataclass(frozen=True)
class TrainerOptions:
    """Options of :class:`~fastdist.DistTrainer`; see its docstring for their meaning."""

    batch_size_per_gpu: int
    n_epochs: int
    update_every: int
    print_every: int
    validate_every: int
    dev_batch_size_per_gpu: int | None
    num_workers: int
    drop_last: bool
    pin_memory: bool | None
    persistent_workers: bool
    prefetch_factor: int | None
    stream_read_ahead_mb: float
    multiprocessing_context: str | None
    seed: int
    metric_key: str | None
    load_best_model: bool
    best_model_format: str
    save_path: str | None
    checkpoint_dir: str | None
    checkpoint_every: int
    keep_checkpoints: int
    checkpoint_async: bool
    use_tqdm: bool
    device: str | torch.device | None
    strategy: Strategy
    amp: str | None
    fp16: bool
    compile: bool
    activation_checkpointing: bool | str
    timeout: float | None
    on_nonfinite: str
    check_sync_every: int | None
    slow_rank_threshold: float

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> TrainerOptions:
        """The options among ``DistTrainer``'s ``arguments`` (by name), checked."""
        given = {f.name: arguments[f.name] for f in fields(cls)}
        if not isinstance(given["strategy"], str):
            what = "'ddp', 'fsdp' or a strategy object"
            check_instance("strategy", given["strategy"], Strategy, what, "DDP(...)")
        given["strategy"] = resolve_strategy(given["strategy"])
        _refuse_unjoined_groups(given["strategy"])
        index, count = given["strategy"].replica_group
        for name in ("save_path", "checkpoint_dir"):
            given[name] = check_path(name, given[name])
            if given[name] is not None and count > 1:  # each group a job with its own files
                given[name] = os.path.join(given[name], f"replica_group{index}")
        check_bool("fp16", given["fp16"])
        if given["fp16"] and given["amp"] not in (None, "fp16"):
            raise ValueError(
                f"fp16=True and amp={describe(given['amp'])} ask for two precisions: pass only "
                "amp='bf16' or amp='fp16' (fp16=True is the same as amp='fp16')"
            )
        if given["fp16"]:  # fastNLP's switch
            given["amp"] = "fp16"
        return cls(**given)

    def __post_init__(self) -> None:
        for name in ("batch_size_per_gpu", "n_epochs", "update_every", "print_every"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("dev_batch_size_per_gpu", "prefetch_factor"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        for name in ("num_workers", "seed", "checkpoint_every"):
            check_int(name, getattr(self, name), minimum=0)
        if self.check_sync_every is not None:
            check_int("check_sync_every", self.check_sync_every, minimum=0)
        if self.seed >= 2**63:  # torch's generators take a signed 64-bit seed
            raise ValueError(f"seed must be below 2**63, got {self.seed}: pass a smaller seed")
        check_int("keep_checkpoints", self.keep_checkpoints, minimum=1)
        check_int("validate_every", self.validate_every, minimum=-1)
        if self.validate_every == 0:
            raise ValueError(
                "validate_every=0 is not valid: use -1 to evaluate at the end of every epoch, "
                "or N > 0 to evaluate every N optimizer updates"
            )
        for name in ("drop_last", "persistent_workers", "load_best_model", "use_tqdm", "fp16"):
            check_bool(name, getattr(self, name))
        check_bool("compile", self.compile)
        check_bool("checkpoint_async", self.checkpoint_async)
        checkpoint_period(self.activation_checkpointing)
        if self.pin_memory is not None:
            check_bool("pin_memory", self.pin_memory)
        if self.timeout is not None:
            check_number("timeout", self.timeout, 0, inclusive=False)
            if not self.timeout <= MAX_TIMEOUT_S:  # inf or 1e30 fail in torch, late
                raise ValueError(
                    f"timeout must be at most {MAX_TIMEOUT_S:.0e} seconds (3 years), got "
                    f"{describe(self.timeout)}: pass the seconds a collective may wait"
                )
        check_number("slow_rank_threshold", self.slow_rank_threshold, 0)
        check_number("stream_read_ahead_mb", self.stream_read_ahead_mb, 0, inclusive=False)
        check_choice("amp", self.amp, (None, "bf16", "fp16"))
        check_choice("multiprocessing_context", self.multiprocessing_context, CONTEXTS)
        check_choice("on_nonfinite", self.on_nonfinite, ("raise", "skip"))
        check_choice("best_model_format", self.best_model_format, FORMATS)
        self.strategy.degrees(get_world_size())  # the layout first: the window assumes it fits
        self.strategy.check_window(self.update_every)
        if self.on_nonfinite == "skip" and self.strategy.local_steps:
            raise ValueError(
                "on_nonfinite='skip' needs the gradients all-reduced every update, so that every "
                "rank skips the same updates; local SGD (DDP(average_every=...)) steps on local "
                "gradients: use on_nonfinite='raise' with it"
            )
        if self.metric_key is not None and not isinstance(self.metric_key, str):
            shown = describe(self.metric_key)
            raise TypeError(f"metric_key must be a str such as 'acc' or '-loss', got {shown}")
        for name in ("save_path", "checkpoint_dir"):
            check_path(name, getattr(self, name))  # of() made them str; writability: arguments
        self._check_workers()

    def _check_workers(self) -> None:
        """The DataLoader worker options that only mean something with workers."""
        for name, given in (
            ("prefetch_factor", self.prefetch_factor is not None),
            ("persistent_workers", self.persistent_workers),
            ("multiprocessing_context", self.multiprocessing_context is not None),
        ):
            if given and self.num_workers == 0:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} applies to DataLoader worker processes, "
                    "but num_workers=0 loads in the training process: set num_workers > 0, or "
                    f"leave {name} out"
                )

    @property
    def checkpointing(self) -> int:
        """``activation_checkpointing`` as a period: every N-th block (0: none)."""
        return checkpoint_period(self.activation_checkpointing)

    @property
    def eval_batch_size(self) -> int:
        return self.dev_batch_size_per_gpu or self.batch_size_per_gpu

    def global_batch(self, data_shards: int) -> int:
        """Samples per optimizer update over all ranks (the nominal figure: a short last
        batch or token batches make some updates smaller); ``data_shards``: the world size,
        over tensor-parallel peers (who run the same batches)."""
        return self.batch_size_per_gpu * data_shards * self.update_every

    def as_dict(self) -> dict[str, Any]:
        """Every option as a number, string, bool or ``None`` (for logs and hyper-parameter
        records); objects appear as their ``repr``."""
        plain = (bool, int, float, str, type(None))
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v if isinstance(v, plain) else repr(v) for k, v in values.items()}


def _refuse_unjoined_groups(strategy: Any) -> None:
    """Raise where the launch starts several replica groups (``python -m fastdist ft``) but
    ``strategy`` does not join them: each group would train the whole job alone, into the
    same ``save_path`` (alike on every process)."""
    groups = os.environ.get(GROUPS_VAR, "")
    if strategy.replica_group[1] == 1 and groups.isdigit() and int(groups) > 1:
        raise ValueError(
            f"this process was launched as one of {groups} torchft replica groups "
            f"({GROUPS_VAR}={groups}, as python -m fastdist ft sets it), but "
            f"strategy={describe(strategy)} does not join them: each group would train the "
            "whole job alone. Pass strategy=DDP(fault_tolerant=True) or "
            "FSDP(fault_tolerant=True), or launch with torchrun"
        )
