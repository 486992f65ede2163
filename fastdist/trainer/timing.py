"""Where each rank's time goes between log steps, and which rank slows the others down.

Every rank splits its time per optimizer update into three parts, from host timestamps
(``time.perf_counter``) that need no device synchronisation on the hot path:

* **data**: blocked in ``next()`` on the DataLoader iterator plus the copy to the device
  (less a stream's per-update agreement, which is collective);
* **collective**: waiting for the others: from the moment this rank's last gradient is
  accumulated (a post-accumulate-grad hook; the first backward hooks every parameter, later
  ones only the parameter whose gradient came last) to the end of ``backward()`` of an
  update, where DDP waits for its gradient all-reduce; plus the trainer's own all-reduces
  (the loss count of ``(sum, count)`` losses, the log-step sync, a stream's agreement on each
  update's batch sizes). A fast rank spends the slow rank's extra time here;
* **compute**: everything else the training loop does: forward, backward, optimizer step,
  callbacks. Evaluation and checkpoint writing are not counted at all.

A rank's **update time** is data + compute: its own work, without waiting for the others.
In synchronous data parallelism every rank's wall time per update is the same (the gradient
all-reduce lines them up), so the wall time cannot tell which rank is slow; the own time can.

Limits, said plainly: DDP starts bucket all-reduces during backward; the part that overlaps
computation costs nothing and is counted as compute; only the wait after the last gradient is
collective. Collectives hidden elsewhere are compute: DDP's buffer broadcast at the start of
the forward (models with buffers), post-local SGD's parameter averaging in the step, FSDP's
all-gathers. On CUDA the host runs ahead of the device, so host timestamps show where the
host waited: at the log step the device is synchronised once and that wait is counted as
collective (the device's work, gradient all-reduce included, that the host did not wait for);
data time stays exact, so a slow data loader is still named, but a slow GPU is not.

The log-step all-reduce carries every rank's figures: each rank writes its three numbers into
its own slot of a ``3 * world_size`` vector (zeros elsewhere) and the sum gives every rank all
of them, with no collective of its own.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastdist.data.feed import to_device
from fastdist.logging import logger

#: Figures per rank in the log-step all-reduce: data, compute, collective (seconds/update).
FIELDS = 3
#: A rank this much slower per update than the median or less is never reported, whatever the
#: threshold: differences of a millisecond or two are scheduler noise on a shared machine.
MIN_EXCESS_S = 0.002
#: Log intervals in a row a rank must be slow in, for the same cause, before it is reported.
SUSTAIN = 3


@dataclass(frozen=True)
class RankTime:
    """One rank's mean seconds per optimizer update over a log interval."""

    rank: int
    data: float
    compute: float
    collective: float

    @property
    def update(self) -> float:
        """This rank's own time per update: data + compute, not waiting for the others."""
        return self.data + self.compute

    def as_dict(self) -> dict[str, float]:
        """Milliseconds, as ``log.jsonl`` and TensorBoard record them."""
        return {
            "rank": self.rank,
            "update_ms": round(self.update * 1e3, 3),
            "data_ms": round(self.data * 1e3, 3),
            "compute_ms": round(self.compute * 1e3, 3),
            "collective_ms": round(self.collective * 1e3, 3),
        }


class RankTimer:
    """This rank's data/compute/collective seconds since the last read (see module docstring).

    The loop wraps its batches in :meth:`batches`, calls :meth:`backward_done` after each
    update's last backward and runs its collectives in :meth:`collective_wait`; evaluation
    and checkpoints run in :meth:`paused`. Per micro-batch only the data wait is added up;
    compute is what is left of the interval's time, found when it is read.
    """

    def __init__(self, device: torch.device, rank: int, world_size: int) -> None:
        self.device, self.rank, self.world_size = device, rank, world_size
        self.data = self.collective = self.left_out = 0.0
        self.updates = 0  # updates since the last read
        self._since: float | None = None  # start of the interval (None: no pass yet)
        self._pass_end: float | None = None  # end of the last pass, while none runs
        self._in_gap = 0.0  # time counted since then (collective waits, pauses)
        self._drawn = 0.0  # when the latest micro-batch was drawn
        self._grads_ready = 0.0  # when this rank's last gradient was accumulated
        self._last_grad: torch.Tensor | None = None  # the parameter stamped last
        self._hooks: dict[int, Any] = {}  # id(parameter) -> hook handle
        self._sent_updates = 0

    @contextlib.contextmanager
    def hooked(self, model: nn.Module) -> Iterator[None]:
        """Stamp when ``model``'s last gradient of each backward is accumulated, while training
        (several ranks only)."""
        if self.world_size == 1:  # nothing to wait for
            yield
            return
        self._hooks = {
            id(p): p.register_post_accumulate_grad_hook(self._stamp_grad)
            for p in model.parameters()
            if p.requires_grad
        }
        try:
            yield
        finally:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks = {}

    def _stamp_grad(self, param: torch.Tensor) -> None:
        self._grads_ready = time.perf_counter()
        self._last_grad = param

    def _keep_last_hook(self) -> None:
        """After a backward: keep only the hook of the gradient that came last (a Python call
        per parameter and backward costs tens of microseconds on a large model)."""
        last = id(self._last_grad)
        for key in [key for key in self._hooks if key != last]:
            self._hooks.pop(key).remove()

    def batches(self, batches: Iterable[Any], device: torch.device) -> Iterator[Any]:
        """Yield ``batches`` moved to ``device``, timing ``next()`` and the copy as data wait;
        what runs between two passes (evaluation, epoch ends...) and is not a collective wait
        is left out."""
        iterator, clock = iter(batches), time.perf_counter
        now = clock()
        self.left_out += self._gap(now)
        if self._since is None:
            self._since = now
        self._pass_end = None
        while True:
            start = clock()
            try:
                batch = to_device(next(iterator), device)
            except StopIteration:
                self._pass_end, self._in_gap = clock(), 0.0
                return
            self._drawn = clock()
            self.data += self._drawn - start
            yield batch

    def _gap(self, now: float) -> float:
        """The time since the last pass ended that nothing counted (0 while a pass runs)."""
        return 0.0 if self._pass_end is None else now - self._pass_end - self._in_gap

    def backward_done(self) -> None:
        """After an update's last backward: split off the wait for the gradient all-reduce."""
        now = time.perf_counter()
        if len(self._hooks) > 1 and self._last_grad is not None:
            self._keep_last_hook()
        self.updates += 1
        if self._grads_ready > self._drawn:  # this backward's gradients were stamped (DDP)
            self.collective += now - self._grads_ready

    @contextlib.contextmanager
    def collective_wait(self) -> Iterator[None]:
        """Count the time inside as waiting in a collective."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.collective += self._counted(start)

    @contextlib.contextmanager
    def collective_in_next(self) -> Iterator[None]:
        """Count the time inside as collective wait though it runs within ``next()`` of
        :meth:`batches` (a stream's agreement on each update), not as data wait."""
        start = time.perf_counter()
        try:
            yield
        finally:
            span = time.perf_counter() - start
            self.collective += span
            self.data -= span

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time inside out (evaluation, checkpoint writing)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.left_out += self._counted(start)

    def _counted(self, start: float) -> float:
        """Seconds since ``start``, noted as counted if they fall between two passes."""
        span = time.perf_counter() - start
        if self._pass_end is not None:
            self._in_gap += span
        return span

    def payload(self) -> list[float]:
        """This rank's slot of the per-rank vector (zeros elsewhere); resets the interval.

        All zeros when no update ran since the last read (then nothing is reset). On CUDA
        the device is synchronised first, and that wait counted as collective.
        """
        values = [0.0] * (FIELDS * self.world_size)
        if not self.updates or self._since is None:
            return values
        if self.device.type == "cuda":
            with self.collective_wait():
                torch.cuda.synchronize(self.device)
        now, n = time.perf_counter(), self.updates
        self.left_out += self._gap(now)
        compute = now - self._since - self.left_out - self.data - self.collective
        slot = FIELDS * self.rank
        values[slot : slot + FIELDS] = [self.data / n, max(compute, 0.0) / n, self.collective / n]
        self._sent_updates = n
        self.data = self.collective = self.left_out = 0.0
        self.updates = 0
        self._since = now
        if self._pass_end is not None:  # the gap goes on, from now
            self._pass_end, self._in_gap = now, 0.0
        return values

    def received(self, values: list[float]) -> tuple[list[RankTime], int] | None:
        """Every rank's figures from the summed vector, and the updates they cover."""
        sent, self._sent_updates = self._sent_updates, 0
        if not sent:  # every rank ran the same updates: all sent zeros
            return None
        return [
            RankTime(rank, *values[FIELDS * rank : FIELDS * (rank + 1)])
            for rank in range(self.world_size)
        ], sent


@dataclass(frozen=True)
class Slow:
    """A rank found slower than the median, and why."""

    rank: int
    excess: float  # 0.42: 42% slower than the median update time
    cause: str  # "data loading" or "compute"
    part: float  # seconds per update of the cause
    update: float  # the rank's update time

    def describe(self, verb: str = "is") -> str:
        return (
            f"rank {self.rank} {verb} {self.excess:.0%} slower than the median: "
            f"{self.cause} {self.part * 1e3:.0f} ms of {self.update * 1e3:.0f} ms per update"
        )


def find_slow(times: list[RankTime], threshold: float, judge_compute: bool = True) -> list[Slow]:
    """Ranks whose update time exceeds the median by more than ``threshold`` (and
    :data:`MIN_EXCESS_S`).

    The cause is the part (data loading or compute) that exceeds its own median the most.
    Without ``judge_compute`` (a strategy whose forward and backward wait for the other ranks,
    as FSDP's all-gathers do, so that a fast rank's compute absorbs a slow rank's time) only
    data loading is judged: a rank whose data time exceeds the median data time by more than
    ``threshold`` of the median update time.

    Example:
        >>> find_slow([RankTime(0, 0.001, 0.007, 0.03), RankTime(1, 0.031, 0.007, 0.0)], 0.1)
        [Slow(rank=1, excess=0.652..., cause='data loading', part=0.031, update=0.038)]
    """
    import statistics  # at log steps only (it costs 2 ms of ``import fastdist``)

    median = statistics.median(t.update for t in times)
    median_data = statistics.median(t.data for t in times)
    median_compute = statistics.median(t.compute for t in times)
    margin = max(threshold * median, MIN_EXCESS_S)
    slow = []
    for t in times:
        data_excess, compute_excess = t.data - median_data, t.compute - median_compute
        if judge_compute and t.update - median > margin:
            by_data = data_excess >= compute_excess
        elif not judge_compute and data_excess > margin:
            by_data = True
        else:
            continue
        cause, part = ("data loading", t.data) if by_data else ("compute", t.compute)
        excess = t.update / median - 1 if median > 0 else math.inf
        if not judge_compute:  # the update times are levelled: say how much of it is data
            excess = data_excess / median if median > 0 else math.inf
        slow.append(Slow(t.rank, excess, cause, part, t.update))
    return slow


class SlowRankReport:
    """Rank 0's WARNINGs about slow ranks: when one is found, when that changes, at the end.

    One log interval proves nothing on a shared machine (another process, the scheduler): a
    rank is reported once it was slow for the same cause in :data:`SUSTAIN` log intervals in
    a row, and the end summary names the ranks that were slow in at least half of the judged
    intervals and on average over them. The first interval (imports, allocator and loader
    warm-up) is recorded but not judged.

    Args:
        threshold: report a rank whose update time exceeds the median by more than this
            fraction (0.1: 10%); 0 turns the report off.
        show: whether this process logs (rank 0).
        judge_compute: whether compute times can tell a slow rank (see :func:`find_slow`).
    """

    def __init__(self, threshold: float, show: bool, judge_compute: bool = True) -> None:
        self.threshold, self.show, self.judge_compute = threshold, show, judge_compute
        self.seen_first = False
        self.current: tuple[tuple[int, str], ...] = ()  # (rank, cause) of the last report
        self.streaks: dict[tuple[int, str], int] = {}  # (rank, cause) -> intervals in a row
        self.totals: list[list[float]] = []  # per rank: data, compute, collective x updates
        self.updates = 0
        self.slow_intervals: dict[int, int] = {}  # rank -> judged intervals it was slow in
        self.intervals = 0
        self.first_step: int | None = None  # the first update judged
        self.last_step = 0  # the step of the last figures seen

    def observe(self, times: list[RankTime], updates: int, step: int) -> None:
        """Judge one interval's figures (``updates`` updates, ending at ``step``)."""
        previous, self.last_step = self.last_step, step
        if not self.seen_first:
            self.seen_first = True
            return
        if not self.threshold or len(times) < 2:
            return
        if not self.totals:
            self.totals = [[0.0] * FIELDS for _ in times]
        for total, t in zip(self.totals, times, strict=True):
            for i, value in enumerate((t.data, t.compute, t.collective)):
                total[i] += value * updates
        self.updates += updates
        self.intervals += 1
        self.first_step = previous + 1 if self.first_step is None else self.first_step
        slow = find_slow(times, self.threshold, self.judge_compute)
        now = {(s.rank, s.cause) for s in slow}
        self.streaks = {key: self.streaks.get(key, 0) + 1 for key in now}
        for s in slow:
            self.slow_intervals[s.rank] = self.slow_intervals.get(s.rank, 0) + 1
        sustained = [s for s in slow if self.streaks[(s.rank, s.cause)] >= SUSTAIN]
        key = tuple((s.rank, s.cause) for s in sustained)
        if key != self.current and self.show:
            if sustained:
                logger.warning("%s (step %d)", "; ".join(s.describe() for s in sustained), step)
            else:
                percent = 100 * self.threshold
                logger.info("no rank is more than %.0f%% slower now (step %d)", percent, step)
        self.current = key

    def summary(self) -> None:
        """Log the run's verdict: the ranks slow on average over the judged intervals and in at
        least half of them, or none."""
        if not (self.show and self.updates):
            return
        times = [
            RankTime(rank, *(value / self.updates for value in total))
            for rank, total in enumerate(self.totals)
        ]
        slow = [
            s
            for s in find_slow(times, self.threshold, self.judge_compute)
            if 2 * self.slow_intervals.get(s.rank, 0) >= self.intervals
        ]
        span = f"updates {self.first_step}-{self.last_step}"
        if slow:
            logger.warning(
                "slow ranks over %s: %s",
                span,
                "; ".join(
                    f"{s.describe('was')} (slow in {self.slow_intervals.get(s.rank, 0)} of "
                    f"{self.intervals} log intervals)"
                    for s in slow
                ),
            )
            return
        import statistics

        median = statistics.median(t.update for t in times)
        logger.info(
            "no rank more than %.0f%% slower than the median over %s (median update time %.1f ms)",
            100 * self.threshold,
            span,
            median * 1e3,
        )
