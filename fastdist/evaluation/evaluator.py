"""Exact sharded evaluation: every dev sample is scored once, statistics reduced once."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

from fastdist.data.feed import to_device
from fastdist.distributed import all_reduce_sum, get_rank
from fastdist.metrics import Metric
from fastdist.modes import evaluating
from fastdist.strategies import Strategy, Topology


class ShardSampler(Sampler[int]):
    """Indices ``rank, rank + world, ...`` of ``range(n)``: no shuffling, no padding duplicates.

    Ranks may get one sample more or less than each other, which is why evaluation never goes
    through DDP's forward (its collectives would then be unmatched).
    """

    def __init__(self, n: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, n, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def padded_batches(
    loader: DataLoader, equal_forwards: bool, shards: int
) -> Iterator[tuple[Any, bool]]:
    """``(batch, is_real)``: this rank's batches of a :class:`ShardSampler` loader (one of
    ``shards``); with ``equal_forwards`` (a sharded model: each forward all-gathers
    parameters, a collective every rank must join) then padding batches (the dataset's first
    sample, to be discarded) until every rank ran as many forwards as the largest shard needs."""
    for batch in loader:
        yield batch, True
    if not equal_forwards:
        return
    batch_size = loader.batch_size or 1
    n = len(loader.dataset)  # type: ignore[arg-type]
    largest_shard = math.ceil(n / shards)
    most = math.ceil(largest_shard / batch_size)
    pad = DataLoader(loader.dataset, batch_size=1, sampler=[0], collate_fn=loader.collate_fn)
    for _ in range(most - len(loader)):
        yield next(iter(pad)), False


class Evaluator:
    """Runs ``metrics`` over a dataset sharded across ranks; the result is the same everywhere.

    Args:
        model: what the forward runs through (a strategy's ``eval_module``).
        equal_forwards: every rank must run equally many forwards (a sharded model).
        forward: ``forward(module, batch)`` (:func:`~fastdist.data.feed.make_forward`).
        topology: the layout, which says this rank's data shard (``None``: every rank one).
    """

    def __init__(
        self,
        model: nn.Module,
        equal_forwards: bool,
        forward: Callable[[nn.Module, Any], Any],
        metrics: Sequence[Metric],
        device: torch.device,
        batch_size: int,
        num_workers: int = 0,
        collate_fn: Callable | None = None,
        group: Any = None,
        multiprocessing_context: Any = None,
        topology: Topology | None = None,
    ) -> None:
        self.model = model
        self.topology = topology or Topology.of(Strategy())
        self.equal_forwards = equal_forwards
        self.forward = forward
        self.metrics = list(metrics)
        self.device = device
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.group = group
        self.multiprocessing_context = multiprocessing_context

    @torch.no_grad()
    def evaluate(self, data: Dataset) -> dict[str, float]:
        """Score ``data`` (a map-style dataset) and return the flat ``{key: value}`` result."""
        shard = self.topology.data_shard  # tensor-parallel peers score the same samples
        sampler = ShardSampler(len(data), shard.rank, shard.size)  # type: ignore[arg-type]
        loader = DataLoader(
            data,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            multiprocessing_context=self.multiprocessing_context,
        )
        for metric in self.metrics:
            metric.reset()
        with evaluating(self.model):
            # A short bar of its own on rank 0, on a terminal only.
            show = get_rank() == 0 and sys.stderr.isatty()
            batches = padded_batches(loader, self.equal_forwards, shard.size)
            for batch, real in tqdm(batches, desc="evaluate", leave=False, disable=not show):
                batch = to_device(batch, self.device)
                output = self.forward(self.model, batch)
                for metric in self.metrics if real and shard.primary else ():
                    metric.update(output, batch)
        states = [metric.state() for metric in self.metrics]
        total = all_reduce_sum(torch.cat(states).to(self.device), self.group).cpu()
        result: dict[str, float] = {}
        for metric, part in zip(self.metrics, total.split([len(s) for s in states]), strict=True):
            result.update(metric.compute(part))
        return result
