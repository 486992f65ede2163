"""Checks of DistTrainer's arguments, run on every rank before any collective."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fastdist.callbacks.callback import Callback
from fastdist.distributed.env import (
    get_local_rank,
    get_local_world_size,
    gpu_shortage,
    visible_gpu_count,
)
from fastdist.metrics import Metric
from fastdist.metrics_torchmetrics import as_fastdist_metric, is_torchmetrics_metric


def check_dataset(name: str, data: Any) -> int:
    """Return the size of a map-style dataset that holds at least one sample."""
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(f"{name} must be a map-style dataset (with __len__ and __getitem__)")
    if len(data) == 0:
        raise ValueError(f"{name} is empty: it must hold at least one sample")
    return len(data)


def as_metric_list(metrics: Any) -> list[Metric]:
    """The ``metrics`` argument as a list of fastdist metrics.

    Accepts a metric, a sequence of them, or a dict ``{key: metric}``. ``torchmetrics.Metric``
    objects are wrapped in :class:`~fastdist.metrics_torchmetrics.TorchMetricsAdapter`,
    reporting their dict key, or else their class name in lower case.
    """
    if metrics is None:
        return []
    if isinstance(metrics, Mapping):
        items = [as_fastdist_metric(metric, key) for key, metric in metrics.items()]
    elif isinstance(metrics, Metric) or is_torchmetrics_metric(metrics):
        items = [as_fastdist_metric(metrics)]
    elif isinstance(metrics, Iterable):
        items = [as_fastdist_metric(metric) for metric in metrics]
    else:
        raise TypeError(f"metrics must be a Metric, a list or a dict, got {type(metrics).__name__}")
    seen: dict[str, str] = {}
    for metric in items:
        for key in metric.keys:
            if key in seen:
                name = type(metric).__name__
                raise ValueError(f"metrics {seen[key]} and {name} both report {key!r}")
            seen[key] = type(metric).__name__
    return items


def resolve_metric_key(metric_key: str | None, metrics: list[Metric]) -> tuple[str, bool]:
    """Return ``(key, larger_is_better)``; a leading ``-`` means lower is better."""
    keys = [key for metric in metrics for key in metric.keys]
    if metric_key is None:
        return (keys[0] if keys else ""), True
    key = metric_key[1:] if metric_key.startswith("-") else metric_key
    if key not in keys:
        raise ValueError(
            f"metric_key={metric_key!r} is not produced by the metrics, which report {keys}"
        )
    return key, not metric_key.startswith("-")


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
    """The trainer's device; ``"auto"``/``None``: ``cuda:LOCAL_RANK`` with CUDA, else the CPU.

    Args:
        device: ``"auto"``, ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        gpu_count: the visible GPUs; default torch's count (0 without CUDA).

    Raises:
        ValueError: a CUDA device that is not there, or (``"auto"``/``"cuda"``) more processes
            on this node than GPUs, which every rank of the node sees alike.
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
        shortage = gpu_shortage(get_local_rank(), get_local_world_size(), gpu_count)
        if shortage is not None:
            raise ValueError(f"device={device!r}: {shortage}")
        return torch.device("cuda", get_local_rank())
    if resolved.index >= gpu_count:
        raise ValueError(
            f"device={device!r} but {gpu_count} GPU(s) are visible (cuda:0 to "
            f"cuda:{gpu_count - 1}): pick one of those or set CUDA_VISIBLE_DEVICES"
        )
    return resolved
