"""Use ``torchmetrics`` metrics in fastdist's evaluation (optional dependency).

torchmetrics is never imported by fastdist: an adapter only calls the methods of the metric
object it wraps, and :func:`is_torchmetrics_metric` looks for torchmetrics in ``sys.modules``
(a program that built a torchmetrics object has imported it).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from fastdist.metrics import Metric


class TorchMetricsAdapter(Metric):
    """A ``torchmetrics.Metric`` behind fastdist's :class:`~fastdist.metrics.Metric` protocol.

    ``update`` feeds ``(pred, target)`` (read with fastdist's field mapping) to the metric,
    moving it to the batch's device first. The metric reduces its own state across ranks:
    ``state()`` is empty and ``compute`` calls ``metric.compute()``, which syncs the ranks
    itself. That sync is a collective, so ``compute`` must run on every rank, as the
    evaluator does; it runs on the metric's ``process_group`` (default: the whole world).

    Args:
        metric: a ``torchmetrics.Metric`` whose ``compute()`` returns a scalar.
        key: the result key it is reported as.
        pred: name of the prediction field in the model output.
        target: name of the target field in the batch.

    Example:
        >>> import torchmetrics
        >>> acc = TorchMetricsAdapter(
        ...     torchmetrics.Accuracy(task="multiclass", num_classes=3), key="tm_acc"
        ... )
        >>> trainer = DistTrainer(..., metrics=[acc], metric_key="tm_acc")
    """

    def __init__(self, metric: Any, key: str, pred: str = "pred", target: str = "target") -> None:
        if not is_torchmetrics_metric(metric):
            raise TypeError(f"metric must be a torchmetrics.Metric, got {type(metric).__name__}")
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        self.metric = metric
        self.keys = (key,)
        super().__init__(pred, target)

    def reset(self) -> None:
        self.metric.reset()

    def update(self, output: Any, batch: Any) -> None:
        pred, target = self.fields(output, batch)
        if self.metric.device != pred.device:
            self.metric.to(pred.device)
        self.metric.update(pred, target)

    def state(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        value = self.metric.compute()  # a collective when a process group is running
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return {self.keys[0]: float(value)}
        if isinstance(value, (int, float)):
            return {self.keys[0]: float(value)}
        kind = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{type(self.metric).__name__}.compute() returned {kind}, not a scalar: configure "
            "it to return one value (e.g. average='macro') or wrap one metric per value"
        )


def is_torchmetrics_metric(obj: Any) -> bool:
    """Whether ``obj`` is a ``torchmetrics.Metric``, without importing torchmetrics.

    Example:
        >>> is_torchmetrics_metric(AccuracyMetric())
        False
    """
    module = sys.modules.get("torchmetrics")
    return module is not None and isinstance(obj, module.Metric)


def as_fastdist_metric(metric: Any, key: str | None = None) -> Metric:
    """Return a fastdist metric as is, and wrap a torchmetrics one in the adapter.

    The adapter's key is ``key`` or, by default, the metric's class name in lower case
    (``MulticlassAccuracy`` reports ``multiclassaccuracy``).

    Example:
        >>> as_fastdist_metric(torchmetrics.Accuracy(task="binary")).keys
        ('binaryaccuracy',)
    """
    if isinstance(metric, Metric):
        if key is not None and key not in metric.keys:
            raise ValueError(f"{type(metric).__name__} reports {metric.keys}, not {key!r}")
        return metric
    if is_torchmetrics_metric(metric):
        return TorchMetricsAdapter(metric, key or type(metric).__name__.lower())
    raise TypeError(
        "metrics must be fastdist Metric or torchmetrics.Metric objects, "
        f"got {type(metric).__name__}"
    )
