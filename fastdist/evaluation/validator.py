"""Evaluation during training: when it is due, which result is the best, the best model."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from torch.utils.data import Dataset

from fastdist.evaluation.best_model import BestModel
from fastdist.evaluation.evaluator import Evaluator
from fastdist.logging import logger
from fastdist.metrics import Metric
from fastdist.metrics_torchmetrics import as_fastdist_metric, is_torchmetrics_metric
from fastdist.state import TrainerState


class Validator:
    """Evaluates ``dev_data`` every ``validate_every`` updates (``-1``: at every epoch end),
    judges each result by ``metric_key`` and keeps the best model.

    Args:
        dev_data: the dev set (``None``: nothing is ever due).
        evaluator: scores a dataset on every rank.
        metric_key: the result key that picks the best model (without its ``-``).
        larger_better: whether larger values of ``metric_key`` are better.
        validate_every: updates between evaluations; ``-1``: at the end of every epoch.
        best: where the best weights are kept.
    """

    def __init__(
        self,
        dev_data: Dataset | None,
        evaluator: Evaluator,
        metric_key: str,
        larger_better: bool,
        validate_every: int,
        best: BestModel,
    ) -> None:
        self.dev_data = dev_data
        self.evaluator = evaluator
        self.metric_key, self.larger_better = metric_key, larger_better
        self.every = validate_every
        self.best = best

    def due_after_update(self, step: int) -> bool:
        """Whether an evaluation is due after optimizer update ``step``."""
        return self.dev_data is not None and self.every > 0 and step % self.every == 0

    @property
    def due_at_epoch_end(self) -> bool:
        return self.dev_data is not None and self.every < 0

    def judge(self, result: dict[str, float], state: TrainerState) -> bool:
        """Record ``result`` in ``state``; keep the model if it is the best so far (on every
        rank: a sharded model is gathered). Return whether it is."""
        value = result[self.metric_key]
        best = None if state.best_eval is None else state.best_eval[self.metric_key]
        if math.isnan(value):  # no model scoring NaN is kept, and none is worse than it
            logger.warning(
                "%s is NaN at step %d: not kept as the best", self.metric_key, state.global_step
            )
            is_better = False
        elif best is None or math.isnan(best):
            is_better = True
        else:
            is_better = value > best if self.larger_better else value < best
        state.eval_result = result
        if is_better:
            state.best_eval, state.best_epoch = result, state.epoch
            state.best_step = state.global_step
            self.best.save()
        logger.info(
            "evaluation at epoch %d step %d: %s%s",
            state.epoch,
            state.global_step,
            ", ".join(f"{k}={v:.6g}" for k, v in result.items()),
            " (best so far)" if is_better else "",
        )
        return is_better


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
