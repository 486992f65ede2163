"""The default training sampler: a seeded order sharded over the ranks, resumable anywhere."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """``torch.randperm(n)`` seeded with ``seed + epoch`` (``DistributedSampler``'s order)."""
    if not shuffle:
        return list(range(n))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).tolist()


class ResumableSampler(Sampler[int]):
    """Shard one epoch's order over the ranks, starting at global position ``start``.

    The order of an epoch is :func:`epoch_order`, and rank ``r`` of ``w`` takes positions
    ``r, r + w, ...`` of it; so after each rank has taken ``k`` samples, positions
    ``0 .. k * w - 1`` are done. :meth:`set_start` skips that prefix: the rest of the epoch is
    sharded over the (possibly different) current ranks, every remaining sample exactly once.
    Nothing is repeated: the shards differ by at most one sample (the trainer lets a shorter
    shard keep in step, see :class:`~fastdist.data.TrainBatches`). With ``drop_last`` the
    rest is cut to a multiple of ``w`` so every shard is equal.
    """

    def __init__(
        self,
        n: int,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.n = n
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch, hence the shuffled order (the same on every rank)."""
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        """Skip the first ``start`` positions of the epoch's order (already trained on)."""
        self.start = start

    def shard_size(self, rank: int, start: int) -> int:
        """Samples rank ``rank`` takes from position ``start`` to the end of the epoch."""
        rest = max(self.n - start, 0)
        if self.drop_last:
            return rest // self.world_size
        return max(rest - rank + self.world_size - 1, 0) // self.world_size

    def __iter__(self) -> Iterator[int]:
        rest = epoch_order(self.n, self.shuffle, self.seed, self.epoch)[self.start :]
        return iter(rest[self.rank :: self.world_size][: len(self)])

    def __len__(self) -> int:
        return self.shard_size(self.rank, self.start)
