"""The default training sampler: DistributedSampler's order, resumable at any sample."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Shard one epoch's order over the ranks, starting at global position ``start``.

    The order of an epoch is ``torch.randperm(n)`` seeded with ``seed + epoch`` (or
    ``range(n)`` without shuffling), exactly as ``DistributedSampler`` makes it, and rank
    ``r`` of ``w`` takes positions ``r, r + w, ...``; so after each rank has taken ``k``
    samples, positions ``0 .. k * w - 1`` are done. :meth:`set_start` skips that prefix: the
    rest of the epoch is sharded over the (possibly different) current ranks, every remaining
    sample once, padded with repeats (or cut, with ``drop_last``) to an equal share per rank
    as ``DistributedSampler`` does.
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

    def _shard(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=generator).tolist()
        else:
            order = list(range(self.n))
        rest = order[self.start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.world_size]
        elif rest and len(rest) % self.world_size:
            padding = self.world_size - len(rest) % self.world_size
            rest += (rest * (padding // len(rest) + 1))[:padding]
        return rest[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._shard())

    def __len__(self) -> int:
        rest = max(self.n - self.start, 0)
        if self.drop_last:
            return rest // self.world_size
        return -(-rest // self.world_size)
