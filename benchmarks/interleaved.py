"""fastdist against the hand-written loop in blocks of a few dozen updates, interleaved inside one
training run: a ratio per block pair that a shared VM's drift does not move.

Run on demand from the repository root (CPU, gloo, 2 processes on 127.0.0.1)::

    python benchmarks/interleaved.py [--cases tiny,accumulation,...] [--scale 1.0]

``run.py`` and ``overhead.py`` pair whole runs of seconds each; on this 2-core VM the speed of
the machine itself drifts by more than 2 % between two such runs. Here one torchrun job
builds, per case, the hand loop of ``overhead.py`` (DDP or FSDP2, its own model and loader)
and a ``DistTrainer`` on the same data. A callback of the trainer (``callbacks_all``, so the
ranks stay in step) stops it every ``block`` updates, at an update 5 past a multiple of 10
(no log step's all-reduce or stream agreement is under way there), and runs ``block`` updates
of the hand loop; the time since the last such stop is fastdist's block. Each pair is two
blocks back to back, a fraction of a second apart. Reported per case, over the pairs (the
first is dropped: warm-up): the median of fastdist's wall time / the hand loop's, with its
quartiles; the ratio of the summed times (epoch ends, rare events included); fastdist's
extra main-thread CPU per update (median); and the garbage collections that started in each
side's blocks (every generation, per 1,000 updates), since a collection scans the heap both
loops share.

The trainer runs with its defaults (``print_every=10``: a log step every 10 updates). With
``--logging-off`` the ``tiny`` and ``accumulation`` cases run twice more: with no log step (so
the quotient says what the log step costs), and against a hand loop that logs the mean loss
over the ranks every 10 updates as fastdist does (one all-reduce, read an update later).
``--control`` runs each case's hand loop against a copy of itself: the noise floor.
``stream_accumulation`` is paired with the map-style accumulation hand loop, so its ratio
divided by ``accumulation``'s is fastdist's stream against fastdist's map-style data.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import child_env, run_job  # noqa: E402
from overhead import EPOCHS, Case, make_case  # noqa: E402
from workloads import SAMPLER_SEED, build_optimizer  # noqa: E402

import fastdist  # noqa: E402
from fastdist import Callback, DistTrainer  # noqa: E402

PREFIX = "INTERLEAVED-JSON "
#: case -> (overhead.py's case, updates per block, block pairs at --scale 1). Blocks are
#: multiples of 10 (the log step) and, for streams, of 16 (the agreement).
CASES = {
    "tiny": ("ddp", 80, 120),
    "medium": ("medium", 10, 16),
    "accumulation": ("accumulation", 80, 40),
    "stream": ("stream", 80, 120),
    "stream_accumulation": ("stream_accumulation", 80, 40),
    "tokens": ("tokens", 80, 20),
    "fsdp": ("fsdp", 80, 100),
}
OFFSET = 5  # the hand block follows updates OFFSET, OFFSET + block, ...


def case_plan(name: str, scale: float) -> tuple[str, int, int]:
    """Case ``name``'s ``overhead.py`` case, updates per block and pairs at ``scale``."""
    base, block, pairs = CASES[name]
    return base, block, max(3, round(pairs * scale))


def hand_updates(case: Case, log_every: int = 0) -> Iterator[None]:
    """The hand-written loop of ``overhead.run_hand``, one optimizer update per ``next()``,
    epoch after epoch. ``log_every``: it also logs the mean loss over the ranks and the updates
    since its last log, as fastdist does: a sum kept on the device, one all-reduce started
    after every ``log_every``-th update and read after the next."""
    model = case.model()
    module = fully_shard(model) if case.sharded else DistributedDataParallel(model)
    optimizer = build_optimizer(model)
    k, updates, losses, pending = case.update_every, 0, torch.zeros((), dtype=torch.float64), None
    for epoch in itertools.count(1):
        for i, batch in enumerate(case.hand_batches(epoch)):
            if (i + 1) % k:
                with module.no_sync():  # type: ignore[operator]
                    loss = case.hand_loss(module(batch[0]), batch)
                    (loss / k).backward()
                if log_every:
                    losses += loss.detach()
                continue
            loss = case.hand_loss(module(batch[0]), batch)
            (loss / k if k > 1 else loss).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1
            if log_every:
                losses += loss.detach()
                if pending is not None:  # the last log's sum and count, one update late
                    pending[0].wait()
                    total, count = pending[1].tolist()
                    LOGGED.append(total / count)
                    pending = None
                if updates % log_every == 0:
                    stats = torch.stack([losses, torch.tensor(log_every * k, dtype=losses.dtype)])
                    pending = dist.all_reduce(stats, async_op=True), stats
                    losses = torch.zeros_like(losses)
            yield


#: The mean losses the hand loop that logs read (kept so that its reads are not optimized out).
LOGGED: list[float] = []


class Interleave(Callback):
    """Runs ``block`` hand updates every ``block`` fastdist updates; records both blocks' wall
    and main-thread CPU seconds; asks the trainer to stop after ``pairs`` + 1 pairs."""

    def __init__(self, hand: Iterator[None], block: int, pairs: int) -> None:
        self.hand, self.block, self.pairs = hand, block, pairs
        self.mark: tuple[float, float] | None = None
        self.times: dict[str, list[tuple[float, float]]] = {"fastdist": [], "hand": []}
        self.side: str | None = None  # whose block runs: counted from the first hand block on
        self.collections = {"fastdist": 0, "hand": 0}

    def count_collection(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry: count each collection that starts in a timed block."""
        if phase == "start" and self.side is not None:
            self.collections[self.side] += 1

    def on_step_end(self) -> None:
        if self.trainer.state.global_step % self.block != OFFSET or self.done:
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        if self.mark is not None:
            self.times["fastdist"].append((wall - self.mark[0], cpu - self.mark[1]))
        self.side = "hand"
        for _ in range(self.block):
            next(self.hand)
        self.mark = time.perf_counter(), time.thread_time()
        self.times["hand"].append((self.mark[0] - wall, self.mark[1] - cpu))
        self.side = None if self.done else "fastdist"
        if self.done:
            self.trainer.request_stop()

    @property
    def done(self) -> bool:
        return len(self.times["hand"]) > self.pairs


def measure(name: str, scale: float, logging: bool, hand_logs: bool = False) -> dict[str, Any]:
    """One interleaved run of case ``name``: each block's (wall, CPU) seconds, pair by pair
    (``logging``: fastdist's log step every 10 updates; ``hand_logs``: the hand loop's too)."""
    base, block, pairs = case_plan(name, scale)
    updates = block * (pairs + 3) + OFFSET + 10  # the stop is agreed at the next log step
    updates *= 2 if base == "tokens" else 1  # a token-budget batch holds about 2 x 32 texts
    case = make_case(base, dist.get_rank(), dist.get_world_size(), updates)
    interleave = Interleave(hand_updates(case, 10 if hand_logs else 0), block, pairs)
    model = case.model()
    gc.callbacks.append(interleave.count_collection)
    trainer = DistTrainer(
        model=model,
        optimizer=build_optimizer(model),
        callbacks_all=[interleave],
        n_epochs=EPOCHS,
        print_every=10 if logging else 10**9,
        use_tqdm=False,
        device="cpu",
        seed=SAMPLER_SEED,
        load_best_model=False,
        **case.fastdist_args,
    )
    try:
        trainer.train()
    finally:
        gc.callbacks.remove(interleave.count_collection)
    # fastdist's block j runs between hand blocks j and j + 1: pair it with the later one.
    fast, hand = interleave.times["fastdist"][1:], interleave.times["hand"][2:]
    # Collections per 1,000 updates of each side (its blocks from the first hand block on).
    gcs = {
        side: 1000 * n / (block * len(interleave.times[side])) if interleave.times[side] else 0.0
        for side, n in interleave.collections.items()
    }
    return {"block": block, "fastdist": fast, "hand": hand, "gc": gcs}


def control(name: str, scale: float) -> dict[str, Any]:
    """Case ``name``'s hand loop against a second copy of itself, blocks alternated as in
    :func:`measure` without a trainer: the noise floor of a pair's ratio."""
    base, block, pairs = case_plan(name, scale)
    rank, world = dist.get_rank(), dist.get_world_size()
    loops = {side: hand_updates(make_case(base, rank, world)) for side in ("fastdist", "hand")}
    times: dict[str, list[tuple[float, float]]] = {"fastdist": [], "hand": []}
    for _ in range(pairs + 1):
        for side, loop in loops.items():
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(block):
                next(loop)
            times[side].append((time.perf_counter() - wall, time.thread_time() - cpu))
    return {"block": block, "fastdist": times["fastdist"][1:], "hand": times["hand"][1:]}


def worker() -> None:
    cases, scale = os.environ["BENCH_CASES"].split(","), float(os.environ["BENCH_SCALE"])
    logging_off = os.environ["BENCH_LOGGING_OFF"] == "1"
    dist.init_process_group("gloo")
    fastdist.logger.setLevel("WARNING")  # the trainers' own lines would bury the result
    results = {name: measure(name, scale, True) for name in cases}
    for name in ("tiny", "accumulation"):
        if logging_off and name in cases:
            results[f"{name} logging off"] = measure(name, scale, False)
            results[f"{name} hand logs too"] = measure(name, scale, True, hand_logs=True)
    for name in cases if os.environ["BENCH_CONTROL"] == "1" else ():
        results[f"{name} control"] = control(name, scale)
    if dist.get_rank() == 0:
        print(PREFIX + json.dumps(results), flush=True)
    dist.destroy_process_group()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def collections(result: dict[str, Any]) -> str:
    """The GC column: collections per 1,000 updates in fastdist's and the hand loop's blocks
    (empty for a control, which counts none)."""
    if "gc" not in result:
        return ""
    return f"{result['gc']['fastdist']:21.1f} / {result['gc']['hand']:.1f}"


def report(results: dict[str, Any]) -> None:
    """Per case: the pairs' wall ratio (median, quartiles), the summed ratio, the CPU extra."""
    print("2 processes, gloo, OMP_NUM_THREADS=1; fastdist / hand per block pair")
    print(
        f"{'case':<26}{'pairs':>6}{'block':>6}{'hand us/upd':>12}"
        f"{'median (q1..q3)':>26}{'summed':>8}{'CPU extra us/upd':>18}"
        f"{'GC per 1k upd (fastdist/hand)':>31}"
    )
    medians: dict[str, float] = {}
    for name, result in results.items():
        fast, hand, block = result["fastdist"], result["hand"], result["block"]
        pairs = list(zip(fast, hand, strict=True))
        q1, median, q3 = quartiles([f[0] / h[0] for f, h in pairs])
        medians[name] = median
        summed = sum(f[0] for f in fast) / sum(h[0] for h in hand)
        extra = statistics.median((f[1] - h[1]) / block * 1e6 for f, h in pairs)
        hand_us = statistics.median(h[0] / block * 1e6 for h in hand)
        print(
            f"{name:<26}{len(pairs):6d}{block:6d}{hand_us:12.0f}"
            f"{median:12.3f} ({q1:.3f}..{q3:.3f}){summed:8.3f}{extra:18.1f}{collections(result)}"
        )
    for name in ("tiny", "accumulation"):
        if f"{name} logging off" in medians:
            quotient = medians[name] / medians[f"{name} logging off"]
            print(f"{name}: defaults / logging off (medians): {quotient:.3f}")
    if "stream_accumulation" in medians and "accumulation" in medians:
        quotient = medians["stream_accumulation"] / medians["accumulation"]
        print(f"stream / map-style with accumulation (medians): {quotient:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--scale", type=float, default=1.0, help="times the pairs per case")
    parser.add_argument("--logging-off", action="store_true", help="tiny, accumulation again")
    parser.add_argument("--control", action="store_true", help="hand against hand as well")
    parser.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = parser.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}: choose from {', '.join(CASES)}")
    env = child_env(
        {
            "BENCH_CASES": args.cases,
            "BENCH_SCALE": str(args.scale),
            "BENCH_LOGGING_OFF": "1" if args.logging_off else "0",
            "BENCH_CONTROL": "1" if args.control else "0",
        }
    )
    results = run_job(os.path.abspath(__file__), 2, env, PREFIX, timeout=3600)
    if args.json:
        print(json.dumps(results))
    report(results)


if __name__ == "__main__":
    worker() if "BENCH_CASES" in os.environ else main()
