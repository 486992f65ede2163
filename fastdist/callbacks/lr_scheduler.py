"""Step a torch learning-rate scheduler after every update, every epoch or every evaluation."""

from __future__ import annotations

from typing import Any

import torch

from fastdist.callbacks.callback import Callback

INTERVALS = ("step", "epoch", "evaluation")


class LRSchedulerCallback(Callback):
    """Call ``scheduler.step()`` after every optimizer update, every epoch or every evaluation.

    Put it in ``callbacks_all``. A ``ReduceLROnPlateau`` steps after every evaluation on the
    ``metric_key`` score (``scheduler.step(score)``); it needs ``dev_data``, and its ``mode``
    must say which way the score improves (``"max"`` for accuracy, ``"min"`` for
    ``metric_key="-loss"``).

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` object built on the trainer's optimizer.
        interval: ``"step"`` (after every update), ``"epoch"`` or ``"evaluation"``; default
            ``"evaluation"`` for a ``ReduceLROnPlateau`` (the only interval it takes), else
            ``"step"``.

    Example:
        >>> sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
        >>> scheduler = LRSchedulerCallback(sched)
    """

    changes_training = True

    def __init__(self, scheduler: Any, interval: str | None = None) -> None:
        if isinstance(scheduler, torch.optim.Optimizer) or not callable(
            getattr(scheduler, "step", None)
        ):
            raise TypeError(
                f"LRSchedulerCallback needs a learning-rate scheduler (with a step() method), "
                f"got {type(scheduler).__name__}: pass one built on the optimizer, e.g. "
                "torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)"
            )
        self.on_score = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if interval is None:
            interval = "evaluation" if self.on_score else "step"
        if interval not in INTERVALS:
            raise ValueError(f"interval must be one of {INTERVALS}, got {interval!r}")
        if self.on_score and interval != "evaluation":
            raise ValueError(
                f"interval={interval!r}: a ReduceLROnPlateau steps on a score, after each "
                "evaluation: leave interval out (or pass interval='evaluation')"
            )
        self.scheduler = scheduler
        self.interval = interval

    def check(self, optimizer: Any, evaluates: bool, metric_key: str, larger_better: bool) -> None:
        """Refuse a scheduler of another optimizer, an evaluation interval without
        ``dev_data``, and a ``ReduceLROnPlateau`` whose ``mode`` reads ``metric_key`` the other
        way round (``DistTrainer`` calls it, alike on every rank)."""
        own = getattr(self.scheduler, "optimizer", optimizer)
        if own is not optimizer:
            raise ValueError(
                f"LRSchedulerCallback's {type(self.scheduler).__name__} steps another optimizer "
                "than the trainer's, so the trainer's learning rate would never change: build "
                "it on the optimizer= you pass to DistTrainer"
            )
        if self.interval == "evaluation" and not evaluates:
            raise ValueError(
                f"LRSchedulerCallback(interval='evaluation') steps "
                f"{type(self.scheduler).__name__} after each evaluation, but there is none: "
                "pass dev_data= and metrics="
            )
        mode = getattr(self.scheduler, "mode", None)
        if self.on_score and mode != ("max" if larger_better else "min"):
            better = "larger" if larger_better else "smaller"
            raise ValueError(
                f"ReduceLROnPlateau(mode={mode!r}) would reduce the learning rate while "
                f"{metric_key} improves ({better} is better): pass "
                f"mode={'max' if larger_better else 'min'!r}"
            )

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def on_step_end(self) -> None:
        if self.interval == "step":
            self.scheduler.step()

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        if self.on_score:
            self.scheduler.step(eval_result[metric_key])
        elif self.interval == "evaluation":
            self.scheduler.step()

    def on_epoch_end(self) -> None:
        if self.interval == "epoch":
            self.scheduler.step()
