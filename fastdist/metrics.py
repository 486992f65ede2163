"""Metrics that keep sufficient statistics per rank and are reduced once per evaluation.

A metric accumulates summable statistics in ``update``; the evaluator concatenates the
``state()`` of every metric, sums it over all ranks in one all-reduce, and hands each metric
its slice in ``compute``. The result is exactly what one process gets on the whole data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fastdist.fields import get_field
from fastdist.losses import Loss, LossFn, as_loss_fn


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
        >>> metric = AccuracyMetric(pred="pred", target="target")
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


class LossMetric(Metric):
    """Mean loss over the evaluated data, reported as ``loss`` (monitor it as ``"-loss"``).

    Each batch adds ``mean loss of the batch x batch size`` and its batch size; the result is
    ``sum / count``. For a loss that is a mean over samples (cross entropy over ``(N, C)``
    logits, MSE per sample...) that is exactly the mean per-sample loss over the data, however
    it is batched or sharded over ranks. A loss averaged over something else (tokens, where
    padding is ignored) is weighted by samples, not tokens, so it then depends slightly on the
    batching. The batch size is the length of ``target`` (or of the batch's first tensor).

    Args:
        loss: a fastdist :class:`~fastdist.losses.Loss` or ``callable(output, batch)`` (their
            own field names apply), a torch loss module (applied to ``pred`` and ``target``),
            or ``None``: the ``loss`` given to ``DistTrainer`` (the output's ``"loss"`` entry
            if it has none, or outside a trainer).
        pred: name of the prediction field, for a torch loss module.
        target: name of the target field (for a torch loss module, and the batch size).

    Example:
        >>> dev_loss = LossMetric(CrossEntropyLoss(), target="target")
        >>> mse = LossMetric(torch.nn.MSELoss(), pred="pred", target="y")
    """

    keys = ("loss",)

    def __init__(self, loss: Any = None, pred: str = "pred", target: str = "target") -> None:
        self.loss_fn: LossFn
        if isinstance(loss, nn.Module) and not isinstance(loss, Loss):

            def module_loss(output: Any, batch: Any) -> torch.Tensor:
                pred_, target_ = self.fields(output, batch)
                return loss(pred_, target_)

            self.loss_fn = module_loss
        else:
            self.loss_fn = as_loss_fn(loss)
        self.own_loss = loss is not None
        super().__init__(pred, target)

    def use_trainer_loss(self, loss_fn: LossFn) -> None:
        """Without a loss of its own, compute the trainer's ``loss_fn`` (``DistTrainer`` calls
        it)."""
        if not self.own_loss:
            self.loss_fn = loss_fn

    def reset(self) -> None:
        self.total: torch.Tensor | float = 0.0  # a device tensor after the first update
        self.count = 0

    def update(self, output: Any, batch: Any) -> None:
        loss = self.loss_fn(output, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"LossMetric: the loss must be a scalar tensor (a mean), got {shape}")
        n = self._batch_size(output, batch)
        self.total = self.total + loss.detach().reshape(()).double() * n
        self.count += n

    def _batch_size(self, output: Any, batch: Any) -> int:
        target: Any
        try:
            target = get_field(output, batch, self.target, from_batch=True)
        except KeyError:
            target = _first_tensor(batch)
        if not isinstance(target, torch.Tensor) or target.dim() == 0:
            raise ValueError(
                f"LossMetric: cannot tell the batch size (no batched {self.target!r} field)"
            )
        return int(target.size(0))

    def state(self) -> torch.Tensor:
        return torch.tensor([float(self.total), float(self.count)], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        total, count = state.tolist()
        return {"loss": total / count if count else math.nan}


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for value in batch:
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


class ClassifyFPreRecMetric(Metric):
    """Precision, recall and F-score of single-label classification, micro and macro averaged.

    Reports fastNLP's names ``f``, ``pre``, ``rec`` (micro: from the true positive, false
    positive and false negative counts summed over the classes) and ``macro_f``, ``macro_pre``,
    ``macro_rec`` (the unweighted mean of the per-class values over the classes that occur in
    the targets or the predictions, as fastNLP and scikit-learn's ``average="macro"`` do).
    With ``only_gross=False`` also ``f-<c>``, ``pre-<c>``, ``rec-<c>`` for every class id
    ``c``. A ratio with a zero denominator is 0. The state is the per-class TP, FP and FN
    counts, so ``num_classes`` is required: it fixes the state's length on every rank. Class
    ids outside ``[0, num_classes)`` make ``compute`` raise (on every rank alike).

    ``pred`` may be logits ``(..., C)`` (argmax is taken) or class ids shaped like
    ``target``. Positions where ``target`` equals ``ignore_index`` are not counted;
    ``ignore_labels`` (class ids, e.g. an "other" class) count in no average.

    Args:
        pred: name of the prediction field in the model output.
        target: name of the target field in the batch.
        num_classes: number of classes ``C``; ids must lie in ``[0, C)``.
        ignore_index: target value of positions to skip (padding).
        ignore_labels: classes left out of the micro and macro averages.
        beta: weight of recall in the F-score (``F_beta``); 1 gives F1.
        only_gross: report only the averages, not the per-class values.

    Example:
        >>> ClassifyFPreRecMetric(num_classes=3).keys[:4]
        ('f', 'pre', 'rec', 'macro_f')
    """

    def __init__(
        self,
        pred: str = "pred",
        target: str = "target",
        num_classes: int | None = None,
        ignore_index: int = -100,
        ignore_labels: Sequence[int] = (),
        beta: float = 1.0,
        only_gross: bool = True,
    ) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(
                "ClassifyFPreRecMetric needs num_classes= (an integer >= 1): the per-class "
                f"counts must have the same length on every rank; got {num_classes!r}"
            )
        if not beta > 0:
            raise ValueError(f"beta must be > 0, got {beta!r}")
        bad = [c for c in ignore_labels if not 0 <= c < num_classes]
        if bad:
            raise ValueError(f"ignore_labels {bad} are not class ids in [0, {num_classes})")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.ignore_labels = sorted(set(ignore_labels))
        self.beta = float(beta)
        self.only_gross = only_gross
        keys = ["f", "pre", "rec", "macro_f", "macro_pre", "macro_rec"]
        if not only_gross:
            for c in range(num_classes):
                if c not in self.ignore_labels:
                    keys += [f"f-{c}", f"pre-{c}", f"rec-{c}"]
        self.keys = tuple(keys)
        super().__init__(pred, target)

    def reset(self) -> None:
        # TP, FP, FN per class, then the number of ids outside [0, C); on the batches' device.
        self.counts: torch.Tensor | None = None

    def update(self, output: Any, batch: Any) -> None:
        pred, target = self.fields(output, batch)
        if pred.dim() == target.dim() + 1:
            pred = pred.argmax(dim=-1)
        if pred.shape != target.shape:
            raise ValueError(
                f"ClassifyFPreRecMetric: pred {tuple(pred.shape)} does not match target "
                f"{tuple(target.shape)} (or target + a class dimension)"
            )
        c = self.num_classes
        mask = target != self.ignore_index
        pred, target = pred[mask].long(), target[mask].long()
        # Ids outside [0, C) are counted, not raised on: one rank raising in update would leave
        # the others waiting in the all-reduce; compute() raises on every rank alike instead.
        valid = (pred >= 0) & (pred < c) & (target >= 0) & (target < c)
        pred, target = pred[valid], target[valid]
        tp = torch.bincount(target[pred == target], minlength=c)
        predicted = torch.bincount(pred, minlength=c)
        actual = torch.bincount(target, minlength=c)
        counts = torch.cat([tp, predicted - tp, actual - tp, (~valid).sum().reshape(1)])
        self.counts = counts if self.counts is None else self.counts + counts

    def state(self) -> torch.Tensor:
        if self.counts is None:
            return torch.zeros(3 * self.num_classes + 1, dtype=torch.float64)
        return self.counts.detach().cpu().double()

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        bad = int(state[-1])
        if bad:
            raise ValueError(
                f"ClassifyFPreRecMetric: {bad} pred/target class id(s) lie outside "
                f"[0, {self.num_classes}) (num_classes={self.num_classes})"
            )
        tp, fp, fn = state[:-1].reshape(3, self.num_classes).tolist()
        classes = [c for c in range(self.num_classes) if c not in self.ignore_labels]
        micro = self._f_pre_rec(
            sum(tp[c] for c in classes), sum(fp[c] for c in classes), sum(fn[c] for c in classes)
        )
        per_class = {c: self._f_pre_rec(tp[c], fp[c], fn[c]) for c in classes}
        present = [c for c in classes if tp[c] + fp[c] + fn[c] > 0]
        result = {"f": micro[0], "pre": micro[1], "rec": micro[2]}
        for i, name in enumerate(("macro_f", "macro_pre", "macro_rec")):
            values = [per_class[c][i] for c in present]
            result[name] = sum(values) / len(values) if values else 0.0
        if not self.only_gross:
            for c in classes:
                f, pre, rec = per_class[c]
                result.update({f"f-{c}": f, f"pre-{c}": pre, f"rec-{c}": rec})
        return result

    def _f_pre_rec(self, tp: float, fp: float, fn: float) -> tuple[float, float, float]:
        pre = tp / (tp + fp) if tp + fp else 0.0
        rec = tp / (tp + fn) if tp + fn else 0.0
        b2 = self.beta**2
        f = (1 + b2) * pre * rec / (b2 * pre + rec) if pre + rec else 0.0
        return f, pre, rec
