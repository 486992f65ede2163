"""Checks of DistTrainer's data arguments (the datasets, samplers, collate_fn), run on every
rank before any collective."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastdist.checks import describe
from fastdist.data import ResumableSampler, ShardedStream, TokenBatchSampler, split_batches
from fastdist.distributed.env import get_world_size
from fastdist.strategies import Strategy, Topology
from fastdist.strategies.replica_groups import refuse_stream
from fastdist.trainer.options import TrainerOptions


def shard_data(train_data: Any, n_train: int | None, batch_sampler: Any, strategy: Strategy) -> int:
    """Tell a token batch sampler this rank's data shard (tensor-parallel peers share one; each
    torchft replica group has its own) and check its lengths against the ``n_train`` samples;
    check a sharded stream's; return how many data shards there are. Raises before any
    collective (the layout is known from the environment)."""
    shard = Topology.of(strategy).data_shard
    every = refuse_stream(train_data, strategy.replica_group, shard)  # torchft's groups
    if isinstance(batch_sampler, TokenBatchSampler):
        batch_sampler.check_samples(n_train)
        batch_sampler.set_shard(every.rank, every.size)
    if isinstance(train_data, ShardedStream):
        train_data.check_shard(shard.rank, shard.size, get_world_size())
    return every.size


def check_collate(collate_fn: Any) -> Any:
    """``collate_fn`` is a function or ``None``; return it."""
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(
            "collate_fn must be a function turning a list of samples into a batch, or None "
            f"(torch's default_collate); got {describe(collate_fn)}"
        )
    return collate_fn


def check_dataset(name: str, data: Any) -> int:
    """Return the size of a map-style dataset that holds at least one sample."""
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")) or isinstance(data, type):
        stream = " or a stream (an IterableDataset)" if name == "train_data" else ""
        raise TypeError(
            f"{name} must be a map-style dataset (with __len__ and __getitem__){stream}, got "
            f"{describe(data)}"
        )
    if len(data) == 0:
        raise ValueError(f"{name} is empty: it must hold at least one sample")
    return len(data)


def check_dev_data(dev_data: Any, validate_every: int) -> None:
    """``dev_data`` is ``None`` or a dataset of at least one sample; ``validate_every`` other
    than its default needs it."""
    if dev_data is not None:
        check_dataset("dev_data", dev_data)
    elif validate_every != -1:
        raise ValueError(
            f"validate_every={validate_every} evaluates dev_data, but none was given: pass "
            "dev_data= (with metrics=), or leave validate_every out"
        )


def check_samplers(
    sampler: Any, batch_sampler: Any, stream: bool, drop_last: bool, one_shape: bool = False
) -> None:
    """At most one of them, each with ``__len__`` (this rank's samples or batches) and
    ``__iter__``; none for a stream (``stream``: train_data is an ``IterableDataset``); a batch
    sampler makes the batches, so ``drop_last`` does not apply to it; no token-budget batches
    where every micro-batch must have one shape (``one_shape``: a pipeline)."""
    if one_shape and isinstance(batch_sampler, TokenBatchSampler):
        raise ValueError(
            "batch_sampler=TokenBatchSampler makes batches of varying numbers of samples, but a "
            "pipeline's stages take micro-batches of one shape: use batch_size_per_gpu= "
            "batches padded to one length in collate_fn (drop_last=True for a short last one)"
        )
    if stream and (sampler is not None or batch_sampler is not None):
        raise ValueError(
            "sampler= and batch_sampler= do not apply to a streaming train_data (an "
            "IterableDataset): fastdist shards it over the ranks and DataLoader workers; "
            "leave both None"
        )
    if sampler is not None and batch_sampler is not None:
        raise ValueError("pass sampler= or batch_sampler=, not both")
    for name, given, unit in (
        ("sampler", sampler, "samples"),
        ("batch_sampler", batch_sampler, "batches"),
    ):
        if isinstance(given, type):
            raise TypeError(
                f"{name}={given.__name__} is a class: pass an instance, built for this rank"
            )
        named = isinstance(given, (str, bytes, Mapping))  # iterable and sized, not samplers
        if given is not None and (
            named or not (hasattr(given, "__len__") and hasattr(given, "__iter__"))
        ):
            raise TypeError(
                f"{name} must be a sampler: an iterable with __len__ (the number of {unit} of "
                f"this rank), got {describe(given)}"
            )
    if isinstance(batch_sampler, (list, tuple)):  # a list of batches, each a list of indices
        for batch in batch_sampler:
            if not isinstance(batch, (list, tuple, range)):
                raise TypeError(
                    "batch_sampler must give each batch as a list of sample indices (e.g. "
                    f"[[0, 1], [2, 3]]), but it holds {describe(batch)}"
                )
    if batch_sampler is not None and drop_last:
        raise ValueError(
            "drop_last=True does not apply with batch_sampler=, which makes every batch itself: "
            "leave drop_last out (or drop short batches in the batch sampler)"
        )


def epoch_batches(n_train: int, shards: int, options: TrainerOptions) -> list[list[int]]:
    """Every data shard's batch sizes (samples) of an epoch, under torch's default sampler."""
    sampler = ResumableSampler(n_train, 0, shards, drop_last=options.drop_last)
    batch, drop = options.batch_size_per_gpu, options.drop_last
    return [split_batches(sampler.shard_size(r, 0), batch, drop) for r in range(shards)]


def check_enough_samples(n_samples: int, batch_size: int, drop_last: bool) -> None:
    """With ``drop_last`` each rank needs at least one full batch per epoch."""
    if drop_last and n_samples < batch_size:
        raise ValueError(
            f"train_data gives each rank {n_samples} samples, fewer than one batch with "
            f"batch_size_per_gpu={batch_size} and drop_last=True: lower batch_size_per_gpu"
        )
