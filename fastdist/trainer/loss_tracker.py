"""Bookkeeping of the training loss: the current update's and the one since the last log line.

Everything stays on the device (no host sync per micro-batch); values are read only when the
trainer logs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastdist.distributed import all_reduce_sum


class LossTracker:
    """Sums of losses and their counts, for one update window and since the last log line.

    A loss is either the mean of its micro-batch (count 1; the micro-batch is weighted by its
    share of the update's samples) or a ``(sum, count)`` pair (e.g. summed token losses and
    the token count), whose gradients are divided by the update's count over all ranks.
    """

    def __init__(self, device: torch.device) -> None:
        self.window_loss = torch.zeros((), device=device)  # of the current update
        self.window_count = torch.zeros((), device=device)
        self.log_loss = torch.zeros((), device=device)  # since the last log line
        self.log_count = torch.zeros((), device=device)
        self.counted = False  # the loss returns (sum, count)

    def add(self, result: Any) -> torch.Tensor:
        """Record one micro-batch's loss function result; return the loss to backpropagate."""
        loss, count = result, 1
        self.counted = isinstance(result, tuple)
        if self.counted:
            loss, count = result
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss must return a scalar tensor (the mean over the micro-batch) or a (sum, "
                f"count) pair, got {shape}: reduce it inside the loss, e.g. with .mean()"
            )
        self.window_loss += loss.detach()
        self.window_count += count
        return loss

    def weight(self, share: float) -> float:
        """A mean weighs by its micro-batch's ``share`` of the update; a sum waits (below)."""
        return 1.0 if self.counted else share

    def normalize(self, model: nn.Module, world_size: int, group: Any) -> None:
        """Divide the summed gradients of a ``(sum, count)`` loss by the update's global count.

        One all-reduce of the count per update, only for such losses: the gradient then equals
        the one-process gradient of the update's total loss over its total count, whatever the
        sizes of the ranks' batches (DDP's mean over ranks is undone by ``world_size``).
        """
        if not self.counted:
            return
        total = all_reduce_sum(self.window_count.detach().double().clone(), group)
        factor = world_size / total.clamp(min=1)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))

    def end_window(self, applied: bool) -> None:
        """Close the update: its loss counts towards the log only if the update was applied."""
        if applied:
            self.log_loss += self.window_loss
            self.log_count += self.window_count
        self.window_loss.zero_()
        self.window_count.zero_()

    def reset_log(self) -> None:
        self.log_loss.zero_()
        self.log_count.zero_()
