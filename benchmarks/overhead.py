"""fastdist's own host time per optimizer update, against hand-written loops, case by case.

Run on demand from the repository root (CPU, gloo, 2 processes on 127.0.0.1)::

    python benchmarks/overhead.py [--cases ddp,accumulation,stream,tokens,fsdp] [--rounds 5]

One torchrun job runs every case's hand-written loop and ``DistTrainer`` on the same model and
data, alternately (the order flips every round), each on a fresh model. For each loop it takes
the main (training) thread's CPU time and the wall time per update after a warm-up. The
thread's CPU time is the host work of the loop itself: a wait in a collective is not CPU time,
and other processes' load barely moves it, so the difference fastdist - hand in the same round
is fastdist's own cost per update (median over the rounds, with min..max); from ``ddp`` (1
micro-batch per update) and ``accumulation`` (4) it splits into a cost per micro-batch and
one per update. Then one more
fastdist run per case under ``cProfile`` (timed by the thread's CPU clock) sums the time spent
in fastdist's own frames (self time of functions in ``fastdist/``) and names the 5 largest.
cProfile adds its own cost to every Python call, so those profiled figures overstate; their
shares are what they are for.

Cases (tiny MLP of ``workloads.py`` unless said): ``ddp`` (batch 32), ``accumulation``
(``update_every=4``), ``stream`` (an ``IterableDataset`` that reads its own part, wrapped in
``ShardedStream``; the hand loop reads the same part), ``tokens`` (a byte model on
``TokenBatchSampler`` batches of random lengths, a ``(sum, count)`` loss; the hand loop divides
by its own count) and ``fsdp`` (``fully_shard`` of the root, as fastdist does with no blocks).

``--loggers`` measures each logging backend's cost per logged step instead (one process; see
``logger_cost.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import child_env, run_job  # noqa: E402
from workloads import (  # noqa: E402
    SAMPLER_SEED,
    WORKLOADS,
    build_data,
    build_model,
    build_optimizer,
)

import fastdist  # noqa: E402
from fastdist import Callback, DistTrainer  # noqa: E402
from fastdist.data import ShardedStream, TokenBatchSampler  # noqa: E402

PREFIX = "OVERHEAD-JSON "
FASTDIST_DIR = os.path.dirname(os.path.abspath(fastdist.__file__)) + os.sep
CASES = ("ddp", "accumulation", "stream", "tokens", "fsdp")
WARMUP, UPDATES, EPOCHS, BATCH = 30, 300, 2, 32
VOCAB, MAX_LEN = 256, 64


class Clock:
    """Wall and main-thread CPU time of the updates after the first :data:`WARMUP`."""

    def __init__(self) -> None:
        self.updates, self.wall0, self.cpu0 = 0, 0.0, 0.0
        self.result: tuple[float, float] | None = None

    def tick(self) -> None:
        self.updates += 1
        if self.updates == WARMUP:
            self.wall0, self.cpu0 = time.perf_counter(), time.thread_time()

    def stop(self) -> None:
        """Microseconds per timed update: (wall, main-thread CPU)."""
        n = self.updates - WARMUP
        wall, cpu = time.perf_counter() - self.wall0, time.thread_time() - self.cpu0
        self.result = (wall / n * 1e6, cpu / n * 1e6)


class Ticks(Callback):
    """Drives a :class:`Clock` from fastdist's hooks."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def on_step_end(self) -> None:
        self.clock.tick()

    def on_train_end(self) -> None:
        self.clock.stop()


@dataclass
class Case:
    """One row: what both loops train, the hand loop's batches and fastdist's arguments."""

    model: Callable[[], nn.Module]
    hand_batches: Callable[[int], Iterable[Any]]  # epoch -> this rank's batches
    hand_loss: Callable[[Any, Any], torch.Tensor]  # (output, batch) -> the batch's mean loss
    fastdist_args: dict[str, Any]  # train_data, loss and the options that differ by case
    update_every: int = 1
    sharded: bool = False  # FSDP instead of DDP


class OwnPart(IterableDataset):
    """Samples ``rank, rank + world, ...`` of a map-style dataset: a stream that splits itself."""

    def __init__(self, data: Any, rank: int, world: int) -> None:
        self.data, self.rank, self.world = data, rank, world

    def __iter__(self) -> Iterator[Any]:
        return (self.data[i] for i in range(self.rank, len(self.data), self.world))


class Texts(Dataset):
    """Random byte strings of the given lengths."""

    def __init__(self, lengths: list[int]) -> None:
        gen = torch.Generator().manual_seed(0)
        self.items = [torch.randint(VOCAB, (n,), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


class ByteModel(nn.Module):
    """Embedding, one hidden layer per position, next-byte logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 64)
        self.hidden = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hidden(self.embed(x))


def pad(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs padded with 0 and targets padded with -100 to the longest sample."""
    longest = max(len(s) for s in samples)
    x = torch.zeros(len(samples), longest - 1, dtype=torch.long)
    y = torch.full((len(samples), longest - 1), -100, dtype=torch.long)
    for i, s in enumerate(samples):
        x[i, : len(s) - 1], y[i, : len(s) - 1] = s[:-1], s[1:]
    return x, y


def token_loss(output: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy summed over the real positions, and their number."""
    y = batch[1]
    total = F.cross_entropy(output.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
    return total, (y != -100).sum()


def mean_token_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    total, count = token_loss(output, batch)
    return total / count


def mean_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


def token_case(size: int) -> Case:
    """Byte strings of 8..MAX_LEN bytes in TokenBatchSampler batches of BATCH x MAX_LEN."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, MAX_LEN + 1, (size,), generator=gen).tolist()
    texts = Texts(lengths)
    sampler = TokenBatchSampler(lengths, BATCH * MAX_LEN, seed=SAMPLER_SEED)

    def hand_batches(epoch: int) -> Iterable[Any]:
        sampler.set_epoch(epoch)
        loader = DataLoader(texts, batch_sampler=sampler, collate_fn=pad)
        # Stop where the rank with fewest batches stops, or DDP would wait for it forever.
        return itertools.islice(loader, min(map(len, sampler.rank_batches(epoch, 0))))

    args = {"train_data": texts, "loss": token_loss, "batch_sampler": sampler, "collate_fn": pad}
    return Case(ByteModel, hand_batches, mean_token_loss, args)


def make_case(name: str, rank: int, world: int, updates: int = WARMUP + UPDATES) -> Case:
    """The case ``name`` for this rank: data for ``updates`` updates over EPOCHS. Beyond
    :data:`CASES`: ``medium`` (the Transformer of ``workloads.py``) and ``stream_accumulation``
    (``stream`` with 4 micro-batches per update, against the map-style hand loop)."""
    wl = WORKLOADS[name if name in ("accumulation", "medium") else "tiny"]
    wl = WORKLOADS["accumulation"] if name == "stream_accumulation" else wl
    per_epoch = -(-updates // EPOCHS)
    size = per_epoch * wl.update_every * wl.batch_size * world
    if name == "tokens":
        return token_case(size)
    data = build_data(wl, size)
    batch = wl.batch_size
    args: dict[str, Any] = {"loss": nn.CrossEntropyLoss(), "batch_size_per_gpu": batch}
    if name == "stream":
        part = OwnPart(data, rank, world)
        args["train_data"] = ShardedStream(OwnPart(data, rank, world))
        return Case(lambda: build_model(wl), lambda _: DataLoader(part, batch), mean_loss, args)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=SAMPLER_SEED)

    def hand_batches(epoch: int) -> Iterable[Any]:
        sampler.set_epoch(epoch)
        return DataLoader(data, batch, sampler=sampler)

    stream = ShardedStream(OwnPart(data, rank, world)) if name == "stream_accumulation" else None
    args.update(train_data=stream or data, update_every=wl.update_every)
    if name == "fsdp":
        args["strategy"] = "fsdp"
    model = lambda: build_model(wl)  # noqa: E731
    return Case(model, hand_batches, mean_loss, args, wl.update_every, name == "fsdp")


def run_hand(case: Case, clock: Clock) -> None:
    """The loop a user writes: DDP (``no_sync`` while accumulating) or ``fully_shard``."""
    model = case.model()
    module = fully_shard(model) if case.sharded else DistributedDataParallel(model)
    optimizer = build_optimizer(model)
    k = case.update_every
    for epoch in range(1, EPOCHS + 1):
        for i, batch in enumerate(case.hand_batches(epoch)):
            update = (i + 1) % k == 0
            with contextlib.nullcontext() if update else module.no_sync():  # type: ignore[operator]
                (case.hand_loss(module(batch[0]), batch) / k).backward()
            if update:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                clock.tick()
    clock.stop()


def run_fastdist(case: Case, clock: Clock) -> None:
    """``DistTrainer`` on the same model, data and optimizer (no evaluation, no logging)."""
    model = case.model()
    DistTrainer(
        model=model,
        optimizer=build_optimizer(model),
        callbacks_all=[Ticks(clock)],
        n_epochs=EPOCHS,
        print_every=10**9,
        use_tqdm=False,
        device="cpu",
        seed=SAMPLER_SEED,
        load_best_model=False,
        **case.fastdist_args,
    ).train()


def own_frames(profile: cProfile.Profile, updates: int) -> dict[str, Any]:
    """Self time in fastdist's frames per update (us), in all and for its 5 largest."""
    own: dict[str, float] = {}
    for (path, line, name), entry in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if path.startswith(FASTDIST_DIR):
            key = f"{path[len(FASTDIST_DIR) :]}:{line} {name}"
            own[key] = own.get(key, 0.0) + entry[2] / updates * 1e6
    top = sorted(own.items(), key=lambda kv: -kv[1])[:5]
    return {"total_us": sum(own.values()), "top": top}


def measure(name: str, rounds: int) -> dict[str, Any]:
    """Alternate the two loops ``rounds`` times, then profile fastdist's once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    case = make_case(name, rank, world)
    times: dict[str, list[tuple[float, float]]] = {"hand": [], "fastdist": []}
    loops = {"hand": run_hand, "fastdist": run_fastdist}
    for round_ in range(rounds + 1):  # round 0 warms imports, allocator and connections
        for label in sorted(loops, reverse=round_ % 2 == 1):
            clock = Clock()
            loops[label](case, clock)
            if round_ and clock.result is not None:
                times[label].append(clock.result)
    clock, profile = Clock(), cProfile.Profile(time.thread_time)
    profile.enable()
    run_fastdist(case, clock)
    profile.disable()
    return {"times": times, "profile": own_frames(profile, clock.updates)}


def worker() -> None:
    cases, rounds = os.environ["BENCH_CASES"].split(","), int(os.environ["BENCH_ROUNDS"])
    dist.init_process_group("gloo")
    fastdist.logger.setLevel("WARNING")  # the trainers' own lines would bury the result
    results = {name: measure(name, rounds) for name in cases}
    if dist.get_rank() == 0:
        print(PREFIX + json.dumps(results), flush=True)
    dist.destroy_process_group()


def spread(values: list[float], digits: int) -> str:
    """The median and the range of ``values``."""
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{median:8.{digits}f} ({low:.{digits}f}..{high:.{digits}f})"


def per_round_extra(result: dict[str, Any]) -> list[float]:
    """fastdist's CPU us per update over the hand loop's, round by round."""
    hand, ours = result["times"]["hand"], result["times"]["fastdist"]
    return [f[1] - h[1] for f, h in zip(ours, hand, strict=True)]


def report(results: dict[str, Any], rounds: int) -> None:
    """Per case: wall and CPU per update of both loops, fastdist's extra, its top frames."""
    print(f"2 processes, gloo, OMP_NUM_THREADS=1; medians of {rounds} rounds (min..max)")
    print(
        f"{'case':<13}{'hand us/upd':>12}{'fastdist':>10}{'wall ratio':>22}"
        f"{'CPU extra us/upd':>30}{'profiled own':>14}"
    )
    for name, result in results.items():
        hand, ours = result["times"]["hand"], result["times"]["fastdist"]
        ratios = [f[0] / h[0] for f, h in zip(ours, hand, strict=True)]
        extra = per_round_extra(result)
        hand_wall = statistics.median(h[0] for h in hand)
        ours_wall = statistics.median(f[0] for f in ours)
        print(
            f"{name:<13}{hand_wall:12.0f}{ours_wall:10.0f}  {spread(ratios, 3)}  "
            f"{spread(extra, 0)}  {result['profile']['total_us']:12.1f}"
        )
    if "ddp" in results and "accumulation" in results:  # 1 and 4 micro-batches per update
        ddp, acc = (per_round_extra(results[name]) for name in ("ddp", "accumulation"))
        micro = [(a - d) / 3 for a, d in zip(acc, ddp, strict=True)]
        update = [d - m for d, m in zip(ddp, micro, strict=True)]
        print(f"own CPU us per micro-batch, (accumulation - ddp) / 3: {spread(micro, 1)}")
        print(f"own CPU us per update, ddp - per micro-batch:        {spread(update, 1)}")
    for name, result in results.items():
        top = ", ".join(f"{key} {us:.1f}" for key, us in result["profile"]["top"])
        print(f"  {name}: {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="also print the result as JSON")
    parser.add_argument("--loggers", action="store_true", help="each logging backend's cost")
    args = parser.parse_args()
    if args.loggers:
        import logger_cost

        logger_cost.report(logger_cost.measure(args.rounds))
        return
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}: choose from {', '.join(CASES)}")
    env = child_env({"BENCH_CASES": args.cases, "BENCH_ROUNDS": str(args.rounds)})
    results = run_job(os.path.abspath(__file__), 2, env, PREFIX, timeout=1800)
    report(results, args.rounds)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    worker() if "BENCH_CASES" in os.environ else main()
