"""What the ranks' comparison of their arguments takes from callbacks, losses and metrics
(fastdist.trainer.same_arguments), in one process: the settings that change training, and
nothing a correct script may hold per rank. The comparison itself runs at 2 ranks in
test_bad_input.py's table."""

from __future__ import annotations

import time

import torch
from torch import nn

from fastdist.callbacks import GradientClipCallback, LRSchedulerCallback, WarmupCallback
from fastdist.trainer.same_arguments import _settings


def scheduler_callback(rank: int) -> LRSchedulerCallback:
    class Budgeted(torch.optim.lr_scheduler.LambdaLR):  # a user's: may hold its rank, a time
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.rank, self.started = rank, time.time()
            super().__init__(optimizer, lambda epoch: 1.0)

    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    return LRSchedulerCallback(Budgeted(optimizer))


def step_lr(gamma: float, rank: int) -> LRSchedulerCallback:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=gamma)
    scheduler.created_at = time.time() + rank  # type: ignore[attr-defined]  # a user's own
    return LRSchedulerCallback(scheduler)


def test_what_a_rank_may_hold_is_not_compared() -> None:
    assert _settings(scheduler_callback(0), "cb") == _settings(scheduler_callback(1), "cb")
    assert _settings(step_lr(0.5, 0), "cb") == _settings(step_lr(0.5, 1), "cb")


def test_settings_that_change_training_are_compared() -> None:
    assert _settings(step_lr(0.5, 0), "cb")["cb.scheduler.gamma"] == "0.5"
    assert _settings(step_lr(0.5, 0), "cb") != _settings(step_lr(0.9, 0), "cb")
    clips = [GradientClipCallback(clip_value=1.0, clip_type=kind) for kind in ("norm", "value")]
    assert _settings(clips[0], "cb")["cb.clip_type"] == "'norm'"
    assert _settings(clips[0], "cb") != _settings(clips[1], "cb")
    warm = [WarmupCallback(warmup=0.1, schedule=kind) for kind in ("linear", "cosine")]
    assert _settings(warm[0], "cb") != _settings(warm[1], "cb")
    weights = [nn.CrossEntropyLoss(weight=torch.tensor([1.0, w])) for w in (2.0, 3.0)]
    assert _settings(weights[0], "loss") != _settings(weights[1], "loss")
    sums = [nn.CrossEntropyLoss(reduction=kind) for kind in ("mean", "sum")]
    assert _settings(sums[0], "loss")["loss.reduction"] == "'mean'"


def test_tensors_of_any_dtype_or_device_are_named() -> None:
    bf16 = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    assert _settings(bf16, "loss")["loss.weight"].startswith("tensor (2,) torch.bfloat16 ")
    meta = nn.CrossEntropyLoss(weight=torch.ones(2, device="meta"))
    assert _settings(meta, "loss")["loss.weight"] == "tensor (2,) torch.float32"
