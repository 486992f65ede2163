"""Token-budget batches: samples of similar length, padded size at most ``max_tokens``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

from fastdist.data.sampler import epoch_order
from fastdist.distributed import get_rank, get_world_size


class TokenBatchSampler(Sampler[list[int]]):
    """Batches whose padded size (longest length x samples) is at most ``max_tokens``.

    An epoch's list of batches depends on ``lengths``, ``seed`` and the epoch only, never on
    the world size: the samples are shuffled from ``seed + epoch``, sorted by length (ties
    stay shuffled), packed greedily, and the batches shuffled again. Rank ``r`` of ``w`` takes
    batches ``r, r + w, ...``, so 1 process with ``update_every=2k`` and ``w`` processes with
    ``update_every=2k/w`` train on the same batches in every update. Every sample is in
    exactly one batch per epoch. Pass it as ``DistTrainer(batch_sampler=...)``.

    Args:
        lengths: the length (tokens) of every sample of the dataset, by index.
        max_tokens: the padded-size budget of one batch (per process).
        shuffle: shuffle per epoch; ``False`` keeps length order.
        seed: the shuffle's seed (the same on every rank).
        rank, world_size: which data shard it gives, of how many; default: this process's
            rank and world size, read when iterating. ``DistTrainer`` sets them to the
            rank's data shard (tensor-parallel peers share one: :meth:`set_shard`).

    Raises:
        ValueError: a sample is longer than ``max_tokens`` (naming its index and length),
            a length is not a positive integer, or ``lengths`` is empty (and, in
            ``DistTrainer``, when ``lengths`` does not have one entry per sample).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.lengths = [int(n) for n in lengths]
        if not self.lengths:
            raise ValueError("TokenBatchSampler got no lengths: the dataset is empty")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        longest = max(range(len(self.lengths)), key=self.lengths.__getitem__)
        if self.lengths[longest] > max_tokens:
            raise ValueError(
                f"sample {longest} has length {self.lengths[longest]} > max_tokens={max_tokens}: "
                "raise max_tokens or truncate/filter such samples"
            )
        if min(self.lengths) < 1:
            raise ValueError(f"lengths must be >= 1, got {min(self.lengths)}")
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self._rank, self._world_size = rank, world_size
        self.epoch = 0
        self.start = 0  # global batches of this epoch already trained on
        self._planned: tuple[int, list[list[int]]] | None = None  # (epoch, its batches)

    @property
    def rank(self) -> int:
        return get_rank() if self._rank is None else self._rank

    @property
    def world_size(self) -> int:
        return get_world_size() if self._world_size is None else self._world_size

    def set_shard(self, rank: int, world_size: int) -> None:
        """Give data shard ``rank`` of ``world_size`` (the trainer's topology says which);
        raise if the constructor named another."""
        given = (self._rank, self._world_size)
        if given != (None, None) and given != (rank, world_size):
            raise ValueError(
                f"TokenBatchSampler(rank={self._rank}, world_size={self._world_size}) names "
                f"another data shard than this rank's ({rank} of {world_size}, tensor-parallel "
                "peers sharing one): leave rank and world_size out inside DistTrainer"
            )
        self._rank, self._world_size = rank, world_size

    def check_samples(self, n: int | None) -> None:
        """Raise unless ``lengths`` has one entry per sample of a dataset of ``n`` (``None``:
        unknown, nothing to check)."""
        if n is not None and n != len(self.lengths):
            raise ValueError(
                f"TokenBatchSampler has {len(self.lengths)} lengths for a train_data of {n} "
                "samples (samples without a length would never train; lengths past the end "
                "would index outside it): pass the length of every sample of train_data, by "
                "index"
            )

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch, hence the batches (the same on every rank)."""
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        """Skip the epoch's first ``start`` batches (already trained on, by all ranks)."""
        self.start = start

    def batches(self, epoch: int) -> list[list[int]]:
        """Every batch of ``epoch``, in training order; independent of the ranks. Kept for
        the epoch's next call (the trainer asks for them three times an epoch)."""
        if self._planned is None or self._planned[0] != epoch:
            self._planned = (epoch, self._pack(epoch))
        return self._planned[1]

    def _pack(self, epoch: int) -> list[list[int]]:
        order = epoch_order(len(self.lengths), self.shuffle, self.seed, epoch)
        order.sort(key=self.lengths.__getitem__)  # stable: equal lengths keep their shuffle
        batches: list[list[int]] = []
        current: list[int] = []
        for i in order:  # ascending lengths: the newest sample is the longest of its batch
            if current and self.lengths[i] * (len(current) + 1) > self.max_tokens:
                batches.append(current)
                current = []
            current.append(i)
        batches.append(current)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        return batches

    def rank_batches(self, epoch: int, start: int) -> list[list[list[int]]]:
        """Every rank's batches of ``epoch`` from global batch ``start`` on."""
        rest = self.batches(epoch)[start:]
        return [rest[r :: self.world_size] for r in range(self.world_size)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.rank_batches(self.epoch, self.start)[self.rank])

    def __len__(self) -> int:
        return len(self.rank_batches(self.epoch, self.start)[self.rank])
