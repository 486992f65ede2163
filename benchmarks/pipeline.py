"""Pipeline benchmark: ms/update of ``Pipeline(stages=2)`` (1F1B, 2 processes, CPU, gloo)
against a hand-written torchtitan-style pipelined loop (each rank a pruned copy of the model
holding its stage's modules only, torch's ``PipelineStage`` and ``Schedule1F1B`` with
``scale_grads=False``, the same micro-batches), paired per round; then each rank's memory
under ``Pipeline(stages=2)`` and ``DDP()``, measured (its parameters plus the rise of
``VmHWM`` over ``train()``) and estimated (``estimate_memory``).

Run from the repository root::

    python benchmarks/pipeline.py [--rounds 5] [--steps 8]

One torchrun job times both loops, each on a fresh model, the order flipping every round;
a second measures the memory. The load average is printed before and after; above half the
cores before the jobs start, the timings are flagged as no result.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import alternating, child_env, run_job  # noqa: E402
from benchmarks.fsdp import StepClock  # noqa: E402
from benchmarks.tp import WIDTH, Block  # noqa: E402  (the same residual MLP block)
from fastdist import DDP, DistTrainer, Pipeline, all_gather_object, estimate_memory  # noqa: E402

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


def run_trainer(steps: int) -> float:
    clock = StepClock()
    trainer(Pipeline(stages=2, schedule="1f1b"), steps, [clock]).train(resume=False)
    return (clock.end - clock.start) / steps * 1000


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


def run_hand(steps: int) -> float:
    """The loop a user writes after torchtitan: a pruned stage, PipelineStage, Schedule1F1B."""
    rank = dist.get_rank()
    module = prune(Model(), rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    loss_fn = nn.CrossEntropyLoss()
    schedule = Schedule1F1B(
        stage, MICRO, loss_fn=lambda out, y: loss_fn(out, y) / MICRO, scale_grads=False
    )
    x, y = data(steps).tensors
    start = 0.0
    for i in range(steps + 1):
        window = slice(i * BATCH * MICRO, (i + 1) * BATCH * MICRO)
        if rank == 0:
            schedule.step(x[window])
        else:
            schedule.step(target=y[window])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            start = time.perf_counter()
    return (time.perf_counter() - start) / steps * 1000


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
    steps = int(os.environ["BENCH_STEPS"])
    dist.init_process_group("gloo")
    result: dict[str, Any] = {}
    if mode == "speed":
        loops = {"hand": lambda: run_hand(steps), "fastdist": lambda: run_trainer(steps)}
        result["ms_per_update"] = alternating(loops, rounds)
    else:
        run_trainer(1)  # warm-up: the first training of a process allocates for good
        strategies = {"pipeline": Pipeline(stages=2), "ddp": DDP()}
        result = {name: all_gather_object(memory(s)) for name, s in strategies.items()}
    if dist.get_rank() == 0:
        print(PREFIX + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
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
    env = child_env(
        {"BENCH_MODE": "speed", "BENCH_ROUNDS": str(args.rounds), "BENCH_STEPS": str(args.steps)}
    )
    times = run_job(script, 2, env, PREFIX, timeout=1800)["ms_per_update"]
    rounded = {k: [round(v, 1) for v in t] for k, t in times.items()}
    print("ms/update by round:", json.dumps(rounded))
    paired = [f / h for f, h in zip(times["fastdist"], times["hand"], strict=True)]
    best = {k: min(t) for k, t in times.items()}
    print(
        f"fastdist / hand (paired per round): median {statistics.median(paired):.3f} "
        f"({min(paired):.3f}..{max(paired):.3f}), best/best {best['fastdist'] / best['hand']:.3f}"
    )
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
