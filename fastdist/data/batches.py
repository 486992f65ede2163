"""The training loader and the plan of each pass: every rank's micro-batch sizes.

Every rank runs the same number of micro-batches per pass, so each update makes the same
collectives on every rank (one gradient all-reduce with DDP; FSDP's per-forward gathers).
Shards differ by at most one sample (or one token batch); a rank whose shard gives one batch
fewer runs a *filler*: its last batch again, weighted 0 (see :func:`window_weights`), in eval
mode so batch-norm statistics and dropout's random numbers are untouched.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset, Sampler

from fastdist.data.sampler import ResumableSampler
from fastdist.data.token_batch import TokenBatchSampler


def window_weights(sizes: Sequence[Sequence[int]], rank: int, update_every: int) -> list[float]:
    """Loss weight of each of this rank's micro-batches so each update averages its samples.

    ``sizes[r]`` are rank ``r``'s micro-batch sizes (samples) of the pass; shorter lists are
    padded with 0 (fillers) to the longest, so every rank runs equally many micro-batches.
    Micro-batches are grouped into windows of ``update_every``; one of ``s`` samples in a
    window of ``n`` samples over all ranks gets ``s * world_size / n`` (DDP's mean over the
    ranks divides by ``world_size``). A short or uneven end is thus weighted exactly as one
    big batch would be, and every rank computes its weights without communicating.
    """
    world, length = len(sizes), max(map(len, sizes), default=0)
    own = list(sizes[rank]) + [0] * (length - len(sizes[rank]))
    weights: list[float] = []
    for start in range(0, length, update_every):
        total = sum(sum(s[start : start + update_every]) for s in sizes)
        weights += [size * world / total for size in own[start : start + update_every]]
    return weights


def split_batches(n_samples: int, batch_size: int, drop_last: bool) -> list[int]:
    """Sizes of the batches ``n_samples`` make: full ones and a short last (unless dropped)."""
    sizes = [batch_size] * (n_samples // batch_size)
    if n_samples % batch_size and not drop_last:
        sizes.append(n_samples % batch_size)
    return sizes


class TrainBatches:
    """This rank's training batches, pass by pass, and every rank's batch sizes.

    A pass is an epoch from a position: ``samples`` (for samplers of samples) or ``batches``
    (for batch samplers) already trained on by all ranks together, 0 at an epoch's start.
    ``weights`` holds the loss weight of each of this rank's micro-batches of the pass (see
    :func:`window_weights`). :class:`~fastdist.data.stream.StreamBatches` is the same
    interface for streams; both implement :class:`~fastdist.data.protocol.Batches`.
    """

    def __init__(
        self,
        data: Dataset,
        batch_size: int,
        sampler: Sampler | None,
        batch_sampler: Sampler | None,
        drop_last: bool,
        seed: int,
        rank: int,
        world_size: int,
        update_every: int,
        **loader_options: Any,
    ) -> None:
        self.batch_size, self.drop_last, self.update_every = batch_size, drop_last, update_every
        self.rank, self.world_size = rank, world_size
        self.by_batch = batch_sampler is not None  # positions count batches, not samples
        if batch_sampler is not None:
            self.sampler: Any = batch_sampler
            self.loader = DataLoader(data, batch_sampler=batch_sampler, **loader_options)
        else:
            self.sampler = sampler or ResumableSampler(
                len(data),  # type: ignore[arg-type]
                rank,
                world_size,
                seed=seed,
                drop_last=drop_last,
            )
            self.loader = DataLoader(
                data, batch_size, sampler=self.sampler, drop_last=drop_last, **loader_options
            )
        self.data = data
        self.sizes: list[list[int]] = []  # every rank's micro-batch sizes of the current pass
        self.weights: list[float] = []
        self.samples: list[int] = []  # this rank's micro-batch sizes, fillers 0
        self._prefix: list[list[int]] = []  # their running sums
        self._skip = 0
        self._start = (0, 0)

    @property
    def plans_uneven(self) -> bool:
        """Whether every rank's sizes are known (else user samplers must give equal shards)."""
        return isinstance(self.sampler, (ResumableSampler, TokenBatchSampler))

    def plan(self, epoch: int, samples: int, batches: int) -> tuple[list[list[int]], int]:
        """Every rank's batch sizes of a pass, and how many batches this rank's loader skips.

        A user sampler is taken to give every rank equal shards (checked at set-up); a user
        batch sampler's batch sizes are unknown, so its micro-batches weigh equally.
        """
        s, w = self.sampler, self.world_size
        if isinstance(s, ResumableSampler):
            shards = [s.shard_size(r, samples) for r in range(w)]
            return [split_batches(n, self.batch_size, self.drop_last) for n in shards], 0
        if isinstance(s, TokenBatchSampler):
            return [[len(b) for b in bs] for bs in s.rank_batches(epoch, batches)], 0
        if self.by_batch:
            skip = batches // w
            return [[1] * (len(s) - skip)] * w, skip
        skip = samples // (self.batch_size * w)
        left = len(s) - skip * self.batch_size
        return [split_batches(left, self.batch_size, self.drop_last)] * w, skip

    def n_updates(self, epoch: int, samples: int = 0, batches: int = 0) -> int:
        """Optimizer updates every rank runs in a pass (windows of the longest shard's
        batches)."""
        n = max(len(sizes) for sizes in self.plan(epoch, samples, batches)[0])
        return -(-n // self.update_every)

    def begin(self, epoch: int, samples: int, batches: int) -> None:
        """Start a pass: set the sampler's epoch and start; plan every rank's batch sizes."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on all ranks
        if self.plans_uneven:
            self.sampler.set_start(batches if self.by_batch else samples)  # no replay
        self.sizes, self._skip = self.plan(epoch, samples, batches)
        self._prefix = [list(itertools.accumulate(sizes, initial=0)) for sizes in self.sizes]
        self._start = (samples, batches)
        self.weights = window_weights(self.sizes, self.rank, self.update_every)
        own = self.sizes[self.rank]
        self.samples = own + [0] * (len(self.weights) - len(own))

    def iterate(self) -> Iterator[Any]:
        """This rank's batches of the pass, then fillers up to the longest shard's count.

        ``iter()`` of the loader runs now (it draws from the torch RNG: the caller orders it
        against restoring a checkpoint's RNG state).
        """
        batches = itertools.islice(iter(self.loader), self._skip, None)
        n = max(map(len, self.sizes), default=0)
        if self.plans_uneven and len(self.sizes[self.rank]) == n:  # the plan is exact: no filler
            return batches
        return self._with_fillers(batches, n)

    def _with_fillers(self, batches: Iterator[Any], n: int) -> Iterator[Any]:
        last, count = None, 0
        for last in batches:
            count += 1
            yield last
        for _ in range(count, n):
            if last is None:  # an empty shard (fewer samples left than ranks)
                last = self.loader.collate_fn([self.data[0]])
            yield last

    def ends_window(self, done: int) -> bool:
        """Whether ``done`` micro-batches end a window (:func:`window_weights`'s)."""
        return done % self.update_every == 0 or done == len(self.weights)

    def ends_pass(self, done: int, wait: bool = False) -> bool:
        """Whether ``done`` micro-batches are the whole pass."""
        return done == len(self.weights)

    def resume_at(self, samples: int, batches: int) -> tuple[int, int]:
        """A resumed pass starts at the checkpoint's position: always exact."""
        return samples, batches

    def state_dict(self) -> None:
        """Nothing: the trainer's position (samples, batches) is all a resume needs."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Nothing to restore."""

    def load_resized(self, states: list[Any]) -> None:
        """Nothing to restore: the rest of the epoch is sharded anew over this world size."""

    def position(self, done: int) -> tuple[int, int]:
        """(samples, batches) of the epoch trained on by all ranks after ``done`` micro-batches
        of this pass each."""
        samples = sum(prefix[min(done, len(prefix) - 1)] for prefix in self._prefix)
        batches = sum(min(done, len(sizes)) for sizes in self.sizes)
        return self._start[0] + samples, self._start[1] + batches
