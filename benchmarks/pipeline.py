"""Pipeline benchmark: ms/update of ``Pipeline(stages=2)`` (1F1B, 2 processes, CPU, gloo)
against a hand-written torchtitan-style pipelined loop (each rank a pruned copy of the model
holding its stage's modules only, torch's ``PipelineStage`` and ``Schedule1F1B`` with
``scale_grads=False``, each update's batch drawn from a ``DataLoader`` as torchtitan's loop
draws it), paired per round; then each rank's memory under ``Pipeline(stages=2)`` and
``DDP()``, measured (its parameters plus the rise of ``VmHWM`` over ``train()``) and
estimated (``estimate_memory``).

Run from the repository root::

    python benchmarks/pipeline.py [--rounds 5] [--steps 8] [--count] [--profile DIR] [--heap]

One torchrun job times both loops, each on a fresh model, the order flipping every round;
a second measures the memory. Besides the wall time it prints what the load of other processes
changes less: each rank's host CPU time (``time.process_time``) and minor page faults per
update, and what CPU fastdist spends beyond its page faults (a fit over the rounds: see
:func:`beyond_faults`). ``--count`` adds one untimed round that counts, per update of the timed
window, the collectives, point-to-point batches and host reads (``Tensor.item``/``tolist``) of
each loop; ``--profile DIR`` writes a cProfile of each rank's timed updates of each loop in the
first round (``DIR/{hand,fastdist}.RANK.prof``); ``--heap`` serves both loops' large tensors
from glibc's heap instead of fresh ``mmap`` pages (page faults per update, 3,000 to 30,000 by
default as the heap happens to lie, are then near 0: less noise, same work). The load average
is printed before and after; above half the cores before the jobs start, the timings are
flagged as no result.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import alternating, child_env, run_job  # noqa: E402
from benchmarks.tp import WIDTH, Block  # noqa: E402  (the same residual MLP block)
from fastdist import DDP, DistTrainer, Pipeline, all_gather_object, estimate_memory  # noqa: E402
from fastdist.callbacks import Callback  # noqa: E402

BLOCKS, DIM, CLASSES, BATCH, MICRO = 8, 64, 10, 32, 8
PREFIX = "PP-BENCH "


class Model(nn.Module):
    """torchtitan's layout: blocks in an ``nn.ModuleDict`` (names survive pruning), a forward
    that skips the modules a stage's copy no longer holds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp: nn.Module | None = nn.Linear(DIM, WIDTH)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(BLOCKS)})
        self.out: nn.Module | None = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) if self.inp is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.out(h) if self.out is not None else h


def data(steps: int) -> TensorDataset:
    n = (steps + 1) * BATCH * MICRO  # +1: the first update is not timed
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, DIM, generator=gen), torch.randint(CLASSES, (n,)))


def trainer(strategy: Any, steps: int, callbacks: list[Any]) -> DistTrainer:
    model = Model()
    return DistTrainer(
        data(steps),
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        loss=nn.CrossEntropyLoss(),
        callbacks_all=callbacks,
        batch_size_per_gpu=BATCH,
        update_every=MICRO,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
    )


#: What the counting shim wraps: collectives and point-to-point batches, and host reads.
COUNTED = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "batch_isend_irecv")
HOST_READS = ("item", "tolist")


class Window:
    """The timed updates of one loop on this rank: wall, host CPU and minor page faults,
    and (``--count``) collectives and host reads, or (``--profile``) a cProfile."""

    def __init__(self, count: bool = False, profile: str | None = None) -> None:
        self.count, self.profile = count, profile
        self.counts: dict[str, int] = {}
        self.profiler = cProfile.Profile() if profile else None
        self.start: tuple[float, float, int] = (0.0, 0.0, 0)
        self.result: dict[str, Any] = {}

    def now(self) -> tuple[float, float, int]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return time.perf_counter(), time.process_time(), faults

    def open(self) -> None:
        if self.count:
            self._shim()
        if self.profiler is not None:
            self.profiler.enable()
        self.start = self.now()

    def close(self, updates: int) -> dict[str, Any]:
        end = self.now()
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.profile)
        if self.count:
            self._unshim()
        wall, cpu, faults = (b - a for a, b in zip(self.start, end, strict=True))
        self.result = {
            "ms": wall / updates * 1000,
            "cpu_ms": cpu / updates * 1000,
            "faults": faults / updates,
            "counts": {k: v / updates for k, v in sorted(self.counts.items())},
        }
        return self.result

    def _shim(self) -> None:
        """Count calls of the collectives and host reads (the originals kept to restore)."""
        self._saved = [(dist, n, getattr(dist, n)) for n in COUNTED]
        self._saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in HOST_READS]
        for owner, name, original in self._saved:
            setattr(owner, name, self._counting(name, original))

    def _counting(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] = self.counts.get(name, 0) + 1
            return original(*args, **kwargs)

        return counted

    def _unshim(self) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)


class Timed(Callback):
    """Opens ``window`` after the first update, closes it after the last (``steps`` later)."""

    def __init__(self, window: Window, steps: int) -> None:
        self.window, self.steps = window, steps

    def on_step_end(self) -> None:
        step = self.trainer.state.global_step
        if step == 1:
            self.window.open()
        elif step == self.steps + 1:
            self.window.close(self.steps)


def run_trainer(steps: int, window: Window) -> dict[str, Any]:
    trainer(Pipeline(stages=2, schedule="1f1b"), steps, [Timed(window, steps)]).train(resume=False)
    return window.result


def prune(model: Model, stage: int) -> Model:
    """torchtitan's stage: a copy of the model without the other stage's modules."""
    part = copy.deepcopy(model)
    half = BLOCKS // 2
    keep = range(half) if stage == 0 else range(half, BLOCKS)
    for name in [n for n in part.blocks if int(n) not in keep]:
        del part.blocks[name]
    if stage == 0:
        part.out = None
    else:
        part.inp = None
    return part


def run_hand(steps: int, window: Window) -> dict[str, Any]:
    """The loop a user writes after torchtitan: a pruned stage, PipelineStage, Schedule1F1B,
    each update's batch drawn from a DataLoader (``next(data_iterator)``)."""
    rank = dist.get_rank()
    module = prune(Model(), rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    loss_fn = nn.CrossEntropyLoss()
    schedule = Schedule1F1B(
        stage, MICRO, loss_fn=lambda out, y: loss_fn(out, y) / MICRO, scale_grads=False
    )
    for i, (x, y) in enumerate(DataLoader(data(steps), batch_size=BATCH * MICRO)):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            window.open()
    return window.close(steps)


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def memory(strategy: Any) -> dict[str, float]:
    """This rank's MiB: estimated (its stage's peak), and measured (parameters held plus the
    rise of VmHWM over train(), 3 updates)."""
    run = trainer(strategy, 2, [])
    x, y = data(0).tensors
    model = Model()
    batch = (x[:BATCH], y[:BATCH])
    optimizer = torch.optim.AdamW(model.parameters())
    loss = nn.CrossEntropyLoss()
    found = estimate_memory(model, optimizer, batch, strategy, 2, loss=loss, update_every=MICRO)
    estimate = (found.stages or (found,))[dist.get_rank() if found.stages else 0]
    held = sum(p.numel() * p.element_size() for p in run.model.parameters())
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_bytes("VmRSS")
    run.train(resume=False)
    measured = held + status_bytes("VmHWM") - before
    mib = 2**20
    return {
        "estimated": estimate.peak / mib,
        "measured": measured / mib,
        "trained": (estimate.gradients + estimate.optimizer) / mib,
    }


def worker() -> None:
    mode, rounds = os.environ["BENCH_MODE"], int(os.environ["BENCH_ROUNDS"])
    steps, profile = int(os.environ["BENCH_STEPS"]), os.environ.get("BENCH_PROFILE")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict[str, Any] = {}
    if mode == "speed":
        runs = {"hand": run_hand, "fastdist": run_trainer}
        first = {name: True for name in runs}

        def timed(name: str) -> dict[str, Any]:
            path = f"{profile}/{name}.{rank}.prof" if profile and first[name] else None
            first[name] = False
            return runs[name](steps, Window(profile=path))

        loops = {name: functools.partial(timed, name) for name in runs}
        result = {"rounds": all_gather_object(alternating(loops, rounds))}
        if os.environ.get("BENCH_COUNT"):
            counted = {name: run(steps, Window(count=True)) for name, run in runs.items()}
            result["counts"] = all_gather_object({k: v["counts"] for k, v in counted.items()})
    else:
        run_trainer(1, Window())  # warm-up: the first training of a process allocates for good
        strategies = {"pipeline": Pipeline(stages=2), "ddp": DDP()}
        result = {name: all_gather_object(memory(s)) for name, s in strategies.items()}
    if rank == 0:
        print(PREFIX + json.dumps(result), flush=True)
    dist.destroy_process_group()


def report_speed(found: dict[str, Any]) -> None:
    """The paired ratios of rank 0's wall times, then each rank's host CPU and page faults."""
    ranks = found["rounds"]  # per rank: {loop: [per-round results]}
    times = {name: [r["ms"] for r in runs] for name, runs in ranks[0].items()}
    rounded = {k: [round(v, 1) for v in t] for k, t in times.items()}
    print("ms/update by round (rank 0's wall time):", json.dumps(rounded))
    paired = [f / h for f, h in zip(times["fastdist"], times["hand"], strict=True)]
    best = {k: min(t) for k, t in times.items()}
    print(
        f"fastdist / hand (paired per round): median {statistics.median(paired):.3f} "
        f"({min(paired):.3f}..{max(paired):.3f}), best/best {best['fastdist'] / best['hand']:.3f}"
    )
    print("per update, median over rounds   hand  fastdist  fastdist/hand")
    for rank, runs in enumerate(ranks):
        for key, label in (("cpu_ms", "host CPU ms"), ("faults", "minor page faults")):
            hand, fast = (statistics.median(r[key] for r in runs[n]) for n in ("hand", "fastdist"))
            ratio = f"{fast / hand:14.3f}" if hand else f"{'-':>14}"  # --heap: often 0 faults
            print(f"  rank {rank} {label:<21} {hand:9.1f} {fast:9.1f} {ratio}")
    for rank, runs in enumerate(ranks):
        print(f"  rank {rank} host CPU beyond page faults: {beyond_faults(runs)}")
    for rank, counts in enumerate(found.get("counts", [])):
        print(f"  rank {rank} calls per update (--count): {json.dumps(counts)}")


def beyond_faults(runs: dict[str, list[dict[str, Any]]]) -> str:
    """fastdist's host CPU per update above the hand loop's, with what page faults cost taken
    out: the least-squares fit, over every round of both loops, of CPU ms = a + b * faults +
    c * (1 for fastdist); c (and b, the cost of one fault) from the rounds' own spread."""
    rows = [
        (r["cpu_ms"], r["faults"], float(name == "fastdist")) for name in runs for r in runs[name]
    ]
    cpu, faults, fast = (numpy.array(column) for column in zip(*rows, strict=True))
    design = numpy.stack([numpy.ones_like(cpu), faults, fast], axis=1)
    (a, b, c), *_ = numpy.linalg.lstsq(design, cpu, rcond=None)
    hand = statistics.median(r["cpu_ms"] for r in runs["hand"])
    return f"{c:+.1f} ms ({c / hand:+.1%} of the hand loop's), a fault {b * 1000:.2f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--count", action="store_true", help="count collectives (1 round more)")
    parser.add_argument("--profile", metavar="DIR", help="cProfile each rank's first round")
    parser.add_argument(
        "--heap", action="store_true", help="large tensors from the heap, not fresh mmap pages"
    )
    args = parser.parse_args()
    script = os.path.abspath(__file__)
    params = sum(p.numel() for p in Model().parameters())
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    print(
        f"model: {params / 1e6:.1f}M parameters, AdamW, 2 ranks (gloo), {MICRO} micro-batches "
        f"of {BATCH} per update, 1F1B; load average {load:.2f} on {cores} cores"
    )
    if load > cores / 2:  # before our own processes: other work competes for the cores
        print("the machine is loaded: these timings are not a result; rerun on an idle one")
    extra = {
        "BENCH_MODE": "speed",
        "BENCH_ROUNDS": str(args.rounds),
        "BENCH_STEPS": str(args.steps),
    }
    if args.count:
        extra["BENCH_COUNT"] = "1"
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        extra["BENCH_PROFILE"] = os.path.abspath(args.profile)
    if args.heap:  # glibc: no mmap below 32 MiB, no trimming: fewer page faults, less noise
        extra |= {"MALLOC_MMAP_THRESHOLD_": str(2**25), "MALLOC_TRIM_THRESHOLD_": str(2**34)}
    report_speed(run_job(script, 2, child_env(extra), PREFIX, timeout=1800))
    env = child_env(
        {"BENCH_MODE": "memory", "BENCH_ROUNDS": "1", "BENCH_STEPS": "2"}
        | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    )
    found = run_job(script, 2, env, PREFIX, timeout=900)
    print("MiB per rank       measured  estimated  measured/estimated  grads+optimizer (est.)")
    for name, ranks in found.items():
        for rank, m in enumerate(ranks):
            ratio = m["measured"] / m["estimated"]
            print(
                f"  {name:<8} rank {rank}  {m['measured']:8.1f} {m['estimated']:10.1f} "
                f"{ratio:19.2f} {m['trained']:23.1f}"
            )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    worker() if "BENCH_MODE" in os.environ else main()
