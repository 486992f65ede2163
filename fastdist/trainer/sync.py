"""Sync points: one all-reduce that returns what every rank agrees on, as a value.

At a log step, before and after an evaluation, at a checkpoint and at the end of training,
every rank contributes its training-loss sum and count, its flags (stop requested, SIGTERM
received, requeue signal received, non-finite parameters), rank 0's proposal of the next signal
check and its time split (see :mod:`fastdist.trainer.timing`); one all-reduce of
``7 + 3 * world_size`` numbers gives every rank all of them. Between log steps further apart
than :data:`~fastdist.trainer.preemption.CHECK_S` seconds, a signal check agrees on the flags
alone (4 numbers), so that a pre-emption is acted on within seconds.

A log step's all-reduce is started (:meth:`Sync.start`) and read later (:meth:`Sync.finish`):
the loop reads it after the next update's forward and backward, so that no rank waits for it
(see :meth:`fastdist.trainer.loop.Loop.log_step`); every other sync point waits at once.

The caller acts on the returned :class:`Agreement`; nothing is set behind its back. Of what
is agreed, only the loss not yet read goes into a checkpoint (``TrainerState.unread_loss``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

from fastdist.distributed import all_reduce_sum
from fastdist.distributed.collectives import start_all_reduce_sum
from fastdist.distributed.position import PositionBoard
from fastdist.trainer.loss_tracker import LossTracker
from fastdist.trainer.preemption import SigtermFlag
from fastdist.trainer.safety import all_finite, failing_ranks
from fastdist.trainer.timing import RankTime, RankTimer


@dataclass(frozen=True)
class Agreement:
    """What every rank learned at a sync point; the same on every rank.

    Attributes:
        stop_requested: some rank asked to stop (:meth:`DistTrainer.request_stop`).
        preempted: some rank got SIGTERM or the requeue signal (a pre-emption: checkpoint,
            then exit).
        loss: the mean training loss over the samples (the tokens, for a ``(sum, count)``
            loss) of every rank's updates since the last read (when asked to read it and some
            update ran), else ``None``.
        rank_times: every rank's mean time split per update since the last sync that covered
            updates, and how many updates it covers; ``None`` if none ran.
        requeue: some rank got the requeue signal of a SLURM job (after the checkpoint, the
            job requeues itself).
        step: the update it was made at: ``loss`` covers the updates up to it.
        pending: where the loss was not read, its sum and count over every rank's updates
            since the last read (a checkpoint keeps them for the next read after a resume).
    """

    stop_requested: bool
    preempted: bool
    loss: float | None
    rank_times: tuple[list[RankTime], int] | None
    requeue: bool = False
    step: int = 0
    pending: tuple[float, float] | None = None

    @property
    def stop(self) -> bool:
        """Whether every rank leaves the training loop now."""
        return self.stop_requested or self.preempted


class Sync:
    """The all-reduce of a sync point (a collective every rank joins at the same place).

    Args:
        losses: this rank's pending training losses.
        timer: this rank's time split.
        model: checked for NaN/Inf parameters when asked.
        raise_nonfinite: a NaN/Inf loss since the last read raises on every rank.
        sigterm: whether this rank was sent SIGTERM or the requeue signal (read at each sync).
        board: this rank's published position.
        device, group: where the numbers go, and over which group.
        across: averages the read loss's sum and count over torchft's replica groups (the
            job's loss, not one group's; the strategy's ``average_over_groups``).
    """

    def __init__(
        self,
        losses: LossTracker,
        timer: RankTimer,
        model: nn.Module,
        raise_nonfinite: bool,
        sigterm: SigtermFlag,
        board: PositionBoard,
        device: torch.device,
        group: Any,
        across: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.losses, self.timer, self.model = losses, timer, model
        self.raise_nonfinite = raise_nonfinite
        self.sigterm, self.board = sigterm, board
        self.device, self.group, self.across = device, group, across
        # The log step's all-reduce under way: its update and the wait for it.
        self._started: tuple[int, Callable[[], torch.Tensor]] | None = None

    def agree(self, step: int, stop_requested: bool, check_model: bool) -> Agreement:
        """One all-reduce at update ``step``, waited for (nothing may be :attr:`started`); the
        pending losses are checked, not read. Raises ``FloatingPointError`` on every rank if
        some rank's loss since the last read was NaN/Inf (``raise_nonfinite``) or, with
        ``check_model``, some rank's parameters are."""
        params = self.model.parameters()
        bad_model = check_model and not all_finite(p.detach() for p in params)
        wait = self._start(step, stop_requested, bad_model, take=False)
        return self._read(step, wait, taken=False, bad_model=bad_model)

    @property
    def started(self) -> bool:
        """Whether a log step's all-reduce is under way (:meth:`finish` reads it)."""
        return self._started is not None

    def start(self, step: int, stop_requested: bool) -> None:
        """Start the log step's all-reduce at update ``step``, taking the pending losses (the
        next updates' are pending next); do not wait for it."""
        self._started = step, self._start(step, stop_requested, bad_model=False, take=True)
        self.board.move(phase="train")

    def finish(self) -> Agreement:
        """Wait for the all-reduce :meth:`start` began and read it, losses included (raises as
        :meth:`agree` does)."""
        assert self._started is not None, "finish() without start()"
        (step, wait), self._started = self._started, None
        return self._read(step, wait, taken=True, bad_model=False)

    def _read(
        self, step: int, wait: Callable[[], torch.Tensor], taken: bool, bad_model: bool
    ) -> Agreement:
        with self.timer.collective_wait():
            reduced = wait().tolist()
        loss_sum, count, stop, preempted, requeue, next_check, bad_models = reduced[:7]
        self.sigterm.checks.agreed(next_check)
        self.board.move(phase="train")
        bad_loss = self.raise_nonfinite and not math.isfinite(loss_sum)
        if bad_models or bad_loss:
            self._raise_nonfinite(bad_loss, bad_model, step, taken)
        if taken:  # every group reads a log step at the same update
            pair = torch.tensor([loss_sum, count], dtype=torch.float64, device=self.device)
            loss_sum, count = self.across(pair).tolist()
            if not count and loss_sum:  # its gradients were divided by 1, not 0
                raise ValueError(
                    f"loss returned (sum, count) pairs whose counts add up to 0 over the updates "
                    f"up to step {step}, but not their sums: count must be the number of items "
                    "(e.g. tokens) the sum is over"
                )
        return Agreement(
            stop_requested=stop > 0,
            preempted=preempted > 0,
            requeue=requeue > 0,
            loss=loss_sum / count if taken and count else None,
            rank_times=self.timer.received(reduced[7:]),
            step=step,
            pending=None if taken else (loss_sum, count),
        )

    def _start(
        self, step: int, stop_requested: bool, bad_model: bool, take: bool
    ) -> Callable[[], torch.Tensor]:
        self.board.publish(step=step, phase="sync")
        flags = self._flags(step, stop_requested) + [float(bad_model)]
        numbers = torch.tensor(
            flags + self.timer.payload(), dtype=torch.float64, device=self.device
        )
        losses = self.losses.take(step) if take else self.losses.pending()
        stats = torch.cat([losses, numbers])
        return start_all_reduce_sum(stats, self.group)

    def check_due(self, step: int) -> bool:
        """Whether the ranks check for signals after update ``step`` (see :meth:`check`)."""
        return self.sigterm.checks.due(step)

    def check(self, step: int, stop_requested: bool) -> Agreement:
        """A signal check: one all-reduce of the flags alone (and the next check's step), no
        loss read, no time split; every rank must call it at the same update."""
        self.board.publish(step=step, phase="sync")
        flags = torch.tensor(self._flags(step, stop_requested), dtype=torch.float64)
        with self.timer.collective_wait():
            stop, preempted, requeue, next_check = all_reduce_sum(
                flags.to(self.device), self.group
            ).tolist()
        self.sigterm.checks.agreed(next_check)
        self.board.move(phase="train")
        return Agreement(
            stop_requested=stop > 0,
            preempted=preempted > 0,
            requeue=requeue > 0,
            loss=None,
            rank_times=None,
            step=step,
        )

    def _flags(self, step: int, stop_requested: bool) -> list[float]:
        """Stop requested, signals received, and rank 0's proposal of the next check."""
        sigterm = self.sigterm
        flags = [float(stop_requested), float(sigterm.received), float(sigterm.requeue)]
        return flags + [sigterm.checks.proposal(step, self.board.rank)]

    def _raise_nonfinite(self, bad_loss: bool, bad_model: bool, step: int, taken: bool) -> NoReturn:
        """Raise on every rank (all are here, agreed), naming who saw what where: a
        non-finite loss first, the cause of the parameters it made NaN, with its first update."""
        if not bad_loss:
            models = failing_ranks(True if bad_model else None, self.group)
            raise FloatingPointError(
                f"the model's parameters are NaN/Inf on ranks {list(models)} at update {step}: "
                "a non-finite gradient was applied (lower the learning rate, clip gradients, "
                "or use on_nonfinite='skip')"
            )
        losses = failing_ranks(self.losses.first_nonfinite(taken), self.group)
        rank, (_, where) = min(losses.items(), key=lambda item: item[1][0])
        raise FloatingPointError(
            f"non-finite loss by update {step}, first at {where} on rank {rank}; ranks with a "
            f"non-finite loss: {list(losses)}; on_nonfinite='skip' skips such updates"
        )
