"""What streaming costs: the same training from a map-style dataset and from a stream.

Run on demand from the repository root, under torchrun (or as one process)::

    torchrun --nproc-per-node=2 benchmarks/stream.py [--workload tiny] [--rounds 5]

Each round trains the workload (``benchmarks/workloads.py``) three times with ``DistTrainer``,
one after the other in the same job (the order reverses every round), on the same samples:
from its ``TensorDataset`` (the default sampler); as an ``IterableDataset`` that every rank
reads whole, keeping its part (``StreamShard``: each rank pays ``world_size`` passes of
reading); and as one that reads only its own part, wrapped in ``ShardedStream`` (as streaming
libraries split by rank). Both streams agree on batch sizes once per ``AGREED_UPDATES``
updates (within ``stream_read_ahead_mb``). Prints ms per update after the warm-up, the ratios
to map-style per round, their medians with min..max, and the agreement all-reduce timed alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset, IterableDataset  # noqa: E402
from worker import Timing, make_sync  # noqa: E402
from workloads import WORKLOADS, Workload, build_data, build_model, build_optimizer, plan  # noqa: E402

from fastdist import Callback, DistTrainer, get_rank, get_world_size, is_master, logger  # noqa: E402
from fastdist.data import ShardedStream  # noqa: E402
from fastdist.data.stream import AGREED_UPDATES  # noqa: E402
from fastdist.distributed import all_reduce_sum  # noqa: E402


class Stream(IterableDataset):
    """The samples of a map-style dataset, in order, as a stream."""

    def __init__(self, data: Dataset) -> None:
        self.data = data

    def __iter__(self) -> Iterator[Any]:
        return (self.data[i] for i in range(len(self.data)))  # type: ignore[arg-type]


class OwnPart(IterableDataset):
    """Samples ``rank, rank + world, ...`` of a map-style dataset: a stream that reads only its
    own part."""

    def __init__(self, data: Dataset, rank: int, world: int) -> None:
        self.data, self.rank, self.world = data, rank, world

    def __iter__(self) -> Iterator[Any]:
        return (self.data[i] for i in range(self.rank, len(self.data), self.world))  # type: ignore[arg-type]


def train(wl: Workload, data: Any, epochs: int) -> float:
    """Milliseconds per update of one fastdist run on ``data``, after ``wl.warmup`` updates."""
    model = build_model(wl)
    timing, sync = Timing(), make_sync(torch.device("cpu"))

    class Clock(Callback):
        def on_step_end(self) -> None:
            if self.trainer.state.global_step == wl.warmup:
                timing.start(sync)

        def on_train_end(self) -> None:
            timing.stop(sync)

    trainer = DistTrainer(
        data,
        model,
        build_optimizer(model),
        loss=nn.CrossEntropyLoss(),
        callbacks_all=[Clock()],
        batch_size_per_gpu=wl.batch_size,
        update_every=wl.update_every,
        n_epochs=epochs,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        load_best_model=False,
    )
    trainer.train()
    return (timing.t1 - timing.t0) / (trainer.state.global_step - wl.warmup) * 1e3


def agreement_us(update_every: int, repeats: int = 2000) -> float:
    """Microseconds per agreement all-reduce (``world_size x (AGREED_UPDATES x update_every +
    1)`` float64)."""
    n = AGREED_UPDATES * update_every + 1
    vector = torch.zeros(get_world_size() * n, dtype=torch.float64)
    all_reduce_sum(vector)  # warm the connection
    start = time.perf_counter()
    for _ in range(repeats):
        all_reduce_sum(vector)
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["tiny", "accumulation"], default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    wl = WORKLOADS[args.workload]
    epochs, per_epoch, size = plan(wl, get_world_size())
    data = build_data(wl, size)
    logger.setLevel("WARNING")  # the trainers' own lines would bury the table
    sources = {
        "map": lambda: data,
        "stream": lambda: Stream(data),
        "own part": lambda: ShardedStream(OwnPart(data, get_rank(), get_world_size())),
    }
    ratios: dict[str, list[float]] = {"stream": [], "own part": []}
    for round_ in range(args.rounds):
        names = list(sources)[:: -1 if round_ % 2 else 1]
        ms = {name: train(wl, sources[name](), epochs) for name in names}
        for name, values in ratios.items():
            values.append(ms[name] / ms["map"])
        if is_master():
            line = ", ".join(f"{name} {ms[name]:.3f}" for name in sources)
            shares = ", ".join(f"{name}/map {values[-1]:.3f}" for name, values in ratios.items())
            print(f"round {round_}: ms/update {line}; {shares}", flush=True)
    agreement = agreement_us(wl.update_every)
    if is_master():
        print(
            f"{args.workload} on {get_world_size()} process(es), {epochs} x {per_epoch} updates; "
            + "; ".join(
                f"median {name}/map {statistics.median(v):.3f} ({min(v):.3f}..{max(v):.3f})"
                for name, v in ratios.items()
            )
            + f"; agreement all-reduce alone {agreement:.0f} us"
        )


if __name__ == "__main__":
    main()
