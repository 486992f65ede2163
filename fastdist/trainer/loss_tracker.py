"""Bookkeeping of the training loss: no device op per micro-batch and no host reads.

Each micro-batch's loss is kept as a detached tensor, and its weight (its samples) as a host
number. Only every :data:`CHUNK` micro-batches, or when a sync point (log step, evaluation,
checkpoint, end of training) reads them, are they weighted and summed per update, in a few
device ops, into a preallocated buffer; the buffer is reduced only at a sync point: the only
places where the trainer reads values. A log step takes the pending updates (:meth:`take`)
and may read their sum later, while the next updates fill the other of two buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastdist.distributed import all_reduce_sum

#: Updates whose losses the buffer holds; beyond that they are folded into one sum, and a
#: non-finite loss among them is located to a range of updates.
BUFFER_SIZE = 1024
#: Micro-batch losses kept as tensors before they are weighted into the buffer. (Keeping
#: many small tensors alive pins their allocations and fragments the heap: +20 KiB each.)
CHUNK = 64


class LossTracker:
    """Losses and their counts of the current update and of the updates since the last read.

    A loss is either the mean of its micro-batch (its gradient weighted by the micro-batch's
    share of the update's samples; recorded as ``mean x samples`` with count ``samples``) or
    a ``(sum, count)`` pair (e.g. summed token losses and the token count), whose gradients
    are divided by the update's count over all ranks. The loss read at a sync point, the sum
    over the ranks divided by their count, is thus the mean over the samples (the tokens) of
    the updates since the last read: the same at any world size.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counted = False  # the loss returns (sum, count)
        self.agreed: bool | None = None  # whether it does, agreed by every rank (a pipeline's)
        self.window: list[torch.Tensor] = []  # micro-batch losses of the current update
        self.window_samples: list[int] = []  # their weights: samples (1 for a sum)
        self.window_count: Any = 0  # their counts (an int, or a tensor for (sum, count))
        # Applied updates' micro-batch losses not yet in the buffer, their weights and how
        # many of them each update has.
        self.held: list[torch.Tensor] = []
        self.held_samples: list[int] = []
        self.held_sizes: list[int] = []
        self.buffer = torch.zeros(BUFFER_SIZE, dtype=torch.float64, device=device)
        self.n_buffered = 0  # updates in the buffer
        self.count: Any = 0
        self.folded: torch.Tensor | None = None  # sum of the first ``n_folded`` of them
        self.n_folded = 0
        self.since_step = 0  # the optimizer step the pending updates follow
        # The updates :meth:`take` read last, as :meth:`first_nonfinite` looks them up: their
        # buffer (the other one now fills), how many, the folded sum, how many in it, and the
        # step they follow.
        spare = torch.zeros_like(self.buffer)
        self.taken: tuple[torch.Tensor, int, torch.Tensor | None, int, int] = (spare, 0, None, 0, 0)

    def add(self, result: Any, share: float = 1.0, samples: int = 1) -> torch.Tensor:
        """Record one micro-batch's loss function result; return the loss to backpropagate.

        ``samples`` is the micro-batch's number of samples (what a mean loss is weighted by
        in the logged loss). A filler micro-batch (``share`` 0) is not recorded: it trains and
        reports nothing.
        """
        loss, count = result, samples
        # The common case, a plain scalar tensor to backpropagate, in three cheap tests.
        if not (type(result) is torch.Tensor and result.ndim == 0 and result.requires_grad):
            loss, count, samples = self._checked(result, samples)
        self.counted = loss is not result
        if share:
            self.window.append(loss.detach())
            self.window_samples.append(samples)
            self.window_count = self.window_count + count
        return loss

    @staticmethod
    def _checked(result: Any, samples: int) -> tuple[torch.Tensor, Any, int]:
        """``(loss, count, samples)`` of a ``(sum, count)`` pair or of a tensor of a subclass;
        raise ``ValueError`` naming the fix for anything else."""
        loss, count = result, samples
        if isinstance(result, tuple):
            if len(result) != 2:
                raise ValueError(
                    f"loss returned a tuple of {len(result)}: return a scalar tensor (the mean "
                    "over the micro-batch) or a (sum, count) pair"
                )
            loss, count = result
            samples = 1
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss must return a scalar tensor (the mean over the micro-batch) or a (sum, "
                f"count) pair, got {shape}: reduce it inside the loss, e.g. with .mean()"
            )
        if not loss.requires_grad:
            raise ValueError(
                "loss returned a tensor that does not require grad (detached, computed under "
                "torch.no_grad(), or made from .item() values): compute it from the model's "
                "output with torch operations"
            )
        return loss, count, samples

    def window_loss(self) -> torch.Tensor:
        """The current update's summed loss, float64 on the device."""
        return self._weighted(self.window, self.window_samples).sum()

    def normalize(
        self,
        model: nn.Module,
        loss_ranks: int,
        group: Any,
        everywhere: bool = False,
        across: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Divide the summed gradients of a ``(sum, count)`` loss by the update's global count.

        One all-reduce of the count per update, only for such losses: the gradient then equals
        the one-process gradient of the update's total loss over its total count, whatever the
        sizes of the ranks' batches (DDP's mean over the ``loss_ranks`` ranks that compute the
        loss is undone). ``everywhere``: ranks that compute no loss (a pipeline's first
        stages) hold gradients too: at the first update every rank joins and learns whether
        the loss returns ``(sum, count)``; after that a mean loss costs nothing here (no
        collective, no host read), and one that turns into a ``(sum, count)`` pair is refused.
        ``across``: the count averaged over torchft's replica groups, whose gradient torchft
        averages (each group's own count would divide it wrongly).
        """
        if everywhere and self.agreed is False:
            if self.counted:
                raise ValueError(
                    "the loss returned a (sum, count) pair after returning a mean at the first "
                    "update, which a pipeline's stages agreed on: return one kind throughout"
                )
            return
        if not (self.counted or everywhere):
            return
        count = torch.as_tensor(self.window_count, device=self.device).detach().double()
        stats = torch.stack([torch.tensor(float(self.counted), device=self.device).double(), count])
        counted, total = all_reduce_sum(stats, group).unbind()
        if everywhere:
            self.agreed = bool(counted.item())
            if not self.agreed:
                return
        if across is not None:
            total = across(total)
        factor = loss_ranks / total.clamp(min=1)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))

    def end_window(self, applied: bool) -> None:
        """Close the update: its loss counts towards the next read only if it was applied."""
        if applied:
            self.held += self.window
            self.held_samples += self.window_samples
            self.held_sizes.append(len(self.window))
            self.count = self.count + self.window_count
            if len(self.held) >= CHUNK:
                self._store()
        self.window, self.window_samples, self.window_count = [], [], 0

    def pending(self) -> torch.Tensor:
        """``[loss sum, count]`` of the updates since the last reset, float64 on the device."""
        self._store()
        loss = self._buffered_sum()
        count = torch.as_tensor(self.count, dtype=torch.float64, device=self.device)
        return torch.stack([loss, count.reshape(())])

    def take(self, step: int) -> torch.Tensor:
        """:meth:`pending`, then forget those updates (read at optimizer step ``step``): the
        updates after it are pending next, while the taken ones may still be looked up."""
        stats = self.pending()
        spare = self.taken[0]  # the buffer taken before: its updates were read
        self.taken = self.buffer, self.n_buffered, self.folded, self.n_folded, self.since_step
        self.buffer = spare
        self.reset(step)
        return stats

    def carry(self, loss_sum: float, count: float) -> None:
        """Hold, as pending, a checkpoint's loss sum and count of every rank's updates that no
        log step read (one rank carries them: the next read sums every rank's)."""
        self.folded = torch.tensor(loss_sum, dtype=torch.float64, device=self.device)
        self.count = count

    def first_nonfinite(self, taken: bool = False) -> tuple[int, str] | None:
        """The step of the first pending (``taken``: last taken) update with a NaN/Inf loss on
        this rank, and words for it (a range if it was folded); ``None`` if all were finite.
        Reads the device.
        """
        self._store()
        buffer, n_buffered, folded, n_folded, since_step = (
            self.taken
            if taken
            else (self.buffer, self.n_buffered, self.folded, self.n_folded, self.since_step)
        )
        first = since_step + 1
        if folded is not None and not torch.isfinite(folded):
            return first, f"one of updates {first}-{first + n_folded - 1}"
        finite = torch.isfinite(buffer[:n_buffered]).tolist()
        if False in finite:
            step = first + n_folded + finite.index(False)
            return step, f"update {step}"
        return None

    def reset(self, step: int) -> None:
        """Forget the pending updates (they were read at optimizer step ``step``)."""
        self._drop_held()
        self.n_buffered, self.count = 0, 0
        self.folded, self.n_folded = None, 0
        self.since_step = step

    def _weighted(self, losses: list[torch.Tensor], samples: list[int]) -> torch.Tensor:
        """``losses`` times their weights, float64 (before weighting: a bf16 loss times 3
        would round)."""
        if not losses:  # only fillers on this rank
            return torch.zeros(1, dtype=torch.float64, device=self.device)
        values = torch.stack(losses).to(torch.float64)
        first = samples[0]
        if samples.count(first) == len(samples):  # the common case: one op, no device copy
            return values if first == 1 else values.mul_(first)
        return values.mul_(torch.tensor(samples, dtype=torch.float64, device=self.device))

    def _update_sums(self) -> torch.Tensor:
        """The held updates' weighted losses summed per update, float64."""
        sizes = self.held_sizes
        size = sizes[0]
        if size and sizes.count(size) == len(sizes):  # the common case: windows alike
            values = self._weighted(self.held, self.held_samples)
            return values if size == 1 else values.view(len(sizes), size).sum(1)
        sums = torch.zeros(len(sizes), dtype=torch.float64, device=self.device)
        if self.held:  # some updates (with fillers, some ranks' all) hold no loss
            update = [i for i, size in enumerate(sizes) for _ in range(size)]
            index = torch.tensor(update, device=self.device)
            sums.index_add_(0, index, self._weighted(self.held, self.held_samples))
        return sums

    def _store(self) -> None:
        """Weigh the held losses and add each update's sum to the buffer, folding the buffer
        into one sum whenever it is full."""
        n = len(self.held_sizes)
        if not n:
            return
        sums = self._update_sums()
        self._drop_held()
        start = 0
        while start < n:
            if self.n_buffered == BUFFER_SIZE:
                self.folded = self._buffered_sum()
                self.n_folded += self.n_buffered
                self.n_buffered = 0
            take = min(n - start, BUFFER_SIZE - self.n_buffered)
            self.buffer[self.n_buffered : self.n_buffered + take] = sums[start : start + take]
            self.n_buffered += take
            start += take

    def _drop_held(self) -> None:
        self.held, self.held_samples, self.held_sizes = [], [], []

    def _buffered_sum(self) -> torch.Tensor:
        total = self.buffer[: self.n_buffered].sum()
        return total if self.folded is None else total + self.folded
