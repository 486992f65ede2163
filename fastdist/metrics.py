"""Metrics that keep sufficient statistics per rank and are reduced once per evaluation.

A metric accumulates summable statistics in ``update``; the evaluator concatenates the
``state()`` of every metric, sums it over all ranks in one all-reduce, and hands each metric
its slice in ``compute``. The result is exactly what one process gets on the whole data.
"""

from __future__ import annotations

from typing import Any

import torch

from fastdist.fields import get_field


class Metric:
    """Base class: subclasses set ``keys`` and implement ``update``, ``state`` and ``compute``.

    Args:
        pred: name of the prediction field in the model output.
        target: name of the target field in the batch.
    """

    keys: tuple[str, ...] = ()

    def __init__(self, pred: str = "pred", target: str = "target") -> None:
        self.pred = pred
        self.target = target
        self.reset()

    def reset(self) -> None:
        """Forget the statistics of the previous evaluation."""
        raise NotImplementedError

    def update(self, output: Any, batch: Any) -> None:
        """Add one batch's statistics (called on every rank for its shard)."""
        raise NotImplementedError

    def state(self) -> torch.Tensor:
        """This rank's statistics as a 1-D float64 tensor that sums across ranks."""
        raise NotImplementedError

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        """Turn the statistics summed over all ranks into ``{key: value}``."""
        raise NotImplementedError

    def fields(self, output: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(pred, target)`` pair of this batch."""
        pred = get_field(output, batch, self.pred, from_batch=False)
        return pred, get_field(output, batch, self.target, from_batch=True)


class AccuracyMetric(Metric):
    """Share of correct predictions, reported as ``acc``.

    ``pred`` may be logits ``(..., C)`` (argmax is taken) or class ids shaped like ``target``.
    Positions where ``target`` equals ``ignore_index`` are not counted.

    Example:
        >>> AccuracyMetric(pred="pred", target="target")
    """

    keys = ("acc",)

    def __init__(self, pred: str = "pred", target: str = "target", ignore_index: int = -100):
        self.ignore_index = ignore_index
        super().__init__(pred, target)

    def reset(self) -> None:
        # Device tensors after the first update: no host sync until ``state()``.
        self.correct: torch.Tensor | int = 0
        self.total: torch.Tensor | int = 0

    def update(self, output: Any, batch: Any) -> None:
        pred, target = self.fields(output, batch)
        if pred.dim() == target.dim() + 1:
            pred = pred.argmax(dim=-1)
        mask = target != self.ignore_index
        self.correct = self.correct + ((pred == target) & mask).sum()
        self.total = self.total + mask.sum()

    def state(self) -> torch.Tensor:
        return torch.tensor([float(self.correct), float(self.total)], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        correct, total = state.tolist()
        return {"acc": correct / total if total else 0.0}
