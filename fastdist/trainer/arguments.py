"""Checks of DistTrainer's arguments, run on every rank before any collective."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Sampler

from fastdist.callbacks.callback import Callback
from fastdist.distributed.env import get_local_rank, get_world_size, visible_gpu_count
from fastdist.evaluation.validator import as_metric_list, resolve_metric_key
from fastdist.losses import as_loss_fn
from fastdist.metrics import Metric
from fastdist.trainer.options import TrainerOptions

#: DistTrainer keywords that became options of a strategy object: name -> (class, option).
MOVED = {
    "find_unused_parameters": ("DDP", "find_unused_parameters"),
    "static_graph": ("DDP", "static_graph"),
    "gradient_as_bucket_view": ("DDP", "gradient_as_bucket_view"),
    "bucket_cap_mb": ("DDP", "bucket_cap_mb"),
    "ddp_comm_hook": ("DDP", "comm_hook"),
    "average_every": ("DDP", "average_every"),
    "fsdp_wrap": ("FSDP", "wrap"),
    "reshard_after_forward": ("FSDP", "reshard_after_forward"),
    "cpu_offload": ("FSDP", "cpu_offload"),
}


@dataclass(frozen=True)
class Arguments:
    """DistTrainer's arguments, checked: the options and the parts to assemble."""

    options: TrainerOptions
    train_data: Dataset
    dev_data: Dataset | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], Any]
    metrics: list[Metric]
    metric_key: str
    larger_better: bool
    callbacks_all: list[Callback]
    callbacks_master: list[Callback]
    sampler: Sampler | None
    batch_sampler: Sampler | None
    collate_fn: Callable | None
    device: torch.device

    @property
    def stream(self) -> bool:
        """Whether ``train_data`` is a stream (an ``IterableDataset``)."""
        return isinstance(self.train_data, IterableDataset)


def check_all(given: Mapping[str, Any], extra: Mapping[str, Any]) -> Arguments:
    """Check every argument of ``DistTrainer`` (``given`` by name, ``extra``: keywords it
    does not take); raise alike on every rank, before any collective."""
    reject_extra(extra, given)
    options = TrainerOptions.of(given)
    model, train_data, dev_data = given["model"], given["train_data"], given["dev_data"]
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    stream = isinstance(train_data, IterableDataset)
    if dev_data is not None:
        check_dataset("dev_data", dev_data)
    sampler, batch_sampler = given["sampler"], given["batch_sampler"]
    check_samplers(sampler, batch_sampler, stream)
    if not stream:
        n_train = check_dataset("train_data", train_data)
        if sampler is None and batch_sampler is None:
            n_rank = n_train // get_world_size()
            check_enough_samples(n_rank, options.batch_size_per_gpu, options.drop_last)
    metrics = as_metric_list(given["metrics"])
    if dev_data is not None and not metrics:
        raise ValueError("dev_data needs metrics=: pass e.g. metrics=AccuracyMetric()")
    metric_key, larger_better = resolve_metric_key(options.metric_key, metrics)
    optimizer = given["optimizer"]
    if optimizer is None:
        optimizer = torch.optim.Adam(model.parameters(), lr=4e-3)
    check_optimizer(optimizer, model)
    device = resolve_device(options.device)
    options.strategy.check(model, optimizer, device, options.amp)
    return Arguments(
        options=options,
        train_data=train_data,
        dev_data=dev_data,
        model=model,
        optimizer=optimizer,
        loss_fn=as_loss_fn(given["loss"]),
        metrics=metrics,
        metric_key=metric_key,
        larger_better=larger_better,
        callbacks_all=check_callbacks("callbacks_all", given["callbacks_all"]),
        callbacks_master=check_callbacks("callbacks_master", given["callbacks_master"]),
        sampler=sampler,
        batch_sampler=batch_sampler,
        collate_fn=given["collate_fn"],
        device=device,
    )


def reject_extra(extra: Mapping[str, Any], known: Collection[str]) -> None:
    """Raise ``TypeError`` for a keyword ``DistTrainer`` does not take, naming where an option
    moved (``bucket_cap_mb`` -> ``DDP(bucket_cap_mb=...)``) or the name meant."""
    for name, value in extra.items():
        if name in MOVED:
            cls, option = MOVED[name]
            which = f"an option of fastdist.strategies.{cls}"
            if option != name:
                which = f"now the {option} option of fastdist.strategies.{cls}"
            raise TypeError(f"{name} is {which}: strategy={cls}({option}={value!r})")
    for name in extra:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise TypeError(f"DistTrainer got an unexpected keyword argument {name!r}{hint}")


def check_dataset(name: str, data: Any) -> int:
    """Return the size of a map-style dataset that holds at least one sample."""
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(f"{name} must be a map-style dataset (with __len__ and __getitem__)")
    if len(data) == 0:
        raise ValueError(f"{name} is empty: it must hold at least one sample")
    return len(data)


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {name}")
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ValueError(
            f"optimizer holds {foreign} tensor(s) that are not parameters of model: build it from "
            "this model after creating the model, e.g. torch.optim.AdamW(model.parameters())"
        )


def check_callbacks(name: str, callbacks: Sequence[Callback] | None) -> list[Callback]:
    items = list(callbacks or [])
    for cb in items:
        if not isinstance(cb, Callback):
            raise TypeError(f"{name} must hold fastdist Callback objects, got {type(cb).__name__}")
    return items


def check_samplers(sampler: Any, batch_sampler: Any, stream: bool) -> None:
    """At most one of them, each with ``__len__`` (this rank's samples or batches); none for a
    stream (``stream``: train_data is an ``IterableDataset``)."""
    if stream and (sampler is not None or batch_sampler is not None):
        raise ValueError(
            "sampler= and batch_sampler= do not apply to a streaming train_data (an "
            "IterableDataset): fastdist shards it over the ranks and DataLoader workers; "
            "leave both None"
        )
    if sampler is not None and batch_sampler is not None:
        raise ValueError("pass sampler= or batch_sampler=, not both")
    for name, given, unit in (
        ("sampler", sampler, "samples"),
        ("batch_sampler", batch_sampler, "batches"),
    ):
        if given is not None and not hasattr(given, "__len__"):
            raise TypeError(f"{name} must have __len__ (the number of {unit} of this rank)")


def check_enough_samples(n_samples: int, batch_size: int, drop_last: bool) -> None:
    """With ``drop_last`` each rank needs at least one full batch per epoch."""
    if drop_last and n_samples < batch_size:
        raise ValueError(
            f"train_data gives each rank {n_samples} samples, fewer than one batch with "
            f"batch_size_per_gpu={batch_size} and drop_last=True: lower batch_size_per_gpu"
        )


def resolve_device(device: str | torch.device | None, gpu_count: int | None = None) -> torch.device:
    """The trainer's device; ``"auto"``/``None``/``"cuda"``: ``cuda:LOCAL_RANK`` (modulo the
    visible GPUs: ``cuda:0`` where a scheduler shows each process its own GPU), else the CPU.
    Whether the processes really have a GPU each is agreed when the group forms
    (:func:`fastdist.distributed.env.agreed_backend`).

    Args:
        device: ``"auto"``, ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        gpu_count: the visible GPUs; default torch's count (0 without CUDA).

    Raises:
        ValueError: a CUDA device that is not there.
    """
    gpu_count = visible_gpu_count() if gpu_count is None else gpu_count
    if device in (None, "auto"):
        resolved = torch.device("cuda" if gpu_count else "cpu")
    else:
        resolved = torch.device(device)
    if resolved.type != "cuda":
        return resolved
    if not gpu_count:
        raise ValueError(f"device={device!r} but CUDA is not available here: use device='cpu'")
    if resolved.index is None:
        return torch.device("cuda", get_local_rank() % gpu_count)
    if resolved.index >= gpu_count:
        raise ValueError(
            f"device={device!r} but {gpu_count} GPU(s) are visible (cuda:0 to "
            f"cuda:{gpu_count - 1}): pick one of those or set CUDA_VISIBLE_DEVICES"
        )
    return resolved
