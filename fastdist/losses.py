"""Losses with fastNLP-style field mapping, and the adapter that turns any loss into one call."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdist.fields import get_field

LossFn = Callable[[Any, Any], torch.Tensor]


class Loss:
    """Base of fastdist losses: reads ``pred`` from the model output and ``target`` from the batch.

    Subclasses implement ``compute(pred, target)`` returning the mean loss of the batch.
    """

    def __init__(self, pred: str = "pred", target: str = "target") -> None:
        self.pred = pred
        self.target = target

    def compute(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, output: Any, batch: Any) -> torch.Tensor:
        pred = get_field(output, batch, self.pred, from_batch=False)
        target = get_field(output, batch, self.target, from_batch=True)
        return self.compute(pred, target)


class CrossEntropyLoss(Loss):
    """Cross entropy of ``pred`` logits ``(N, C)`` or ``(N, L, C)`` against class ids.

    Example:
        >>> loss = CrossEntropyLoss(pred="pred", target="target", padding_idx=-100)
    """

    def __init__(
        self,
        pred: str = "pred",
        target: str = "target",
        padding_idx: int = -100,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(pred, target)
        self.padding_idx = padding_idx
        self.label_smoothing = label_smoothing

    def compute(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            pred.reshape(-1, pred.size(-1)),
            target.reshape(-1),
            ignore_index=self.padding_idx,
            label_smoothing=self.label_smoothing,
        )


def as_loss_fn(loss: Any) -> LossFn:
    """Turn the ``loss`` argument of ``DistTrainer`` into ``fn(output, batch) -> Tensor``.

    Accepts a fastdist :class:`Loss`, a torch loss module (applied to ``pred`` and ``target``),
    any ``callable(output, batch)``, or ``None`` (the model output's ``"loss"`` entry).
    """
    if loss is None:
        return _output_loss
    if isinstance(loss, Loss):
        return loss
    if isinstance(loss, nn.Module):
        return lambda output, batch: loss(
            get_field(output, batch, "pred", from_batch=False),
            get_field(output, batch, "target", from_batch=True),
        )
    if callable(loss):
        return loss
    raise TypeError(
        f"loss must be a fastdist Loss, a torch loss module, a callable(output, batch) or None; "
        f"got {type(loss).__name__}"
    )


def _output_loss(output: Any, batch: Any) -> torch.Tensor:
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    raise ValueError("loss=None needs the model to return a dict with a 'loss' entry")
