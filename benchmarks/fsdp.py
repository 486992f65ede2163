"""FSDP benchmark: memory per rank and ms/step of strategy="fsdp" vs a hand-written FSDP2 loop
and vs strategy="ddp", on a ~33M-parameter MLP of 14 blocks (parameters + AdamW dominate).

Run from the repository root (CPU, gloo, 2 processes)::

    python benchmarks/fsdp.py [--rounds 5] [--steps 10]

One torchrun job times the three loops paired per round (hand FSDP2, fastdist FSDP, fastdist
DDP, each on a fresh model, in an order that flips every round); two more jobs train a few
steps with one strategy each, for the peak RSS of a process that only ever held that
strategy's state.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import alternating, child_env, run_job  # noqa: E402
from fastdist import Callback, DistTrainer, get_rank  # noqa: E402

HIDDEN, BLOCKS, DIM, CLASSES, BATCH = 1536, 14, 64, 10, 8
PREFIX = "FSDP-BENCH "


class BlockMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(BLOCKS)
        )
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def data(steps: int) -> TensorDataset:
    n = (steps + 1) * BATCH * dist.get_world_size()  # +1: the first step is not timed
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, DIM, generator=gen), torch.randint(CLASSES, (n,)))


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients (as many as parameters: the same shards,
    held through backward and the step) and optimizer state."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    optim = sum(local(v) for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    return {"params": params, "grads": params, "optimizer": optim, "total": 2 * params + optim}


class StepClock(Callback):
    """Wall time from the end of the first update to the end of the last."""

    def __init__(self) -> None:
        self.start = self.end = 0.0

    def on_step_end(self) -> None:
        self.end = time.perf_counter()
        if self.trainer.state.global_step == 1:
            self.start = self.end


def run_trainer(strategy: str, steps: int) -> tuple[float, dict[str, int]]:
    model = BlockMLP()
    clock = StepClock()
    trainer = DistTrainer(
        data(steps),
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        loss=nn.CrossEntropyLoss(),
        callbacks_all=[clock],
        batch_size_per_gpu=BATCH,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
    )
    trainer.train(resume=False)
    return (clock.end - clock.start) / steps * 1000, state_bytes(trainer.model, trainer.optimizer)


def run_hand_fsdp(steps: int) -> tuple[float, dict[str, int]]:
    """The loop a user would write with FSDP2: fully_shard per block, then the root."""
    model = BlockMLP()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dataset = data(steps)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset))
    loss_fn = nn.CrossEntropyLoss()
    start = 0.0
    for i, (x, y) in enumerate(loader):
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            start = time.perf_counter()
    return (time.perf_counter() - start) / steps * 1000, state_bytes(model, optimizer)


def worker() -> None:
    mode, rounds = os.environ["BENCH_MODE"], int(os.environ["BENCH_ROUNDS"])
    steps = int(os.environ["BENCH_STEPS"])
    dist.init_process_group("gloo")
    result: dict[str, Any] = {}
    if mode == "speed":
        loops = {
            "hand_fsdp": lambda: run_hand_fsdp(steps)[0],
            "fsdp": lambda: run_trainer("fsdp", steps)[0],
            "ddp": lambda: run_trainer("ddp", steps)[0],
        }
        result["ms_per_step"] = alternating(loops, rounds)
    else:
        _, result["bytes"] = run_trainer(mode, 3)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if get_rank() == 0:
        print(PREFIX + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    script = os.path.abspath(__file__)
    params = sum(p.numel() for p in BlockMLP().parameters())
    print(f"model: {params / 1e6:.1f}M parameters, AdamW, batch {BATCH} per rank, 2 ranks, gloo")
    memory = {}
    for mode in ("ddp", "fsdp"):
        env = child_env({"BENCH_MODE": mode, "BENCH_ROUNDS": "1", "BENCH_STEPS": "3"})
        memory[mode] = run_job(script, 2, env, PREFIX, timeout=600)
    mib = 2**20
    print("per rank (rank 0)      DDP MiB   FSDP MiB   FSDP/DDP")
    for key in ("params", "grads", "optimizer", "total"):
        d, f = memory["ddp"]["bytes"][key], memory["fsdp"]["bytes"][key]
        print(f"  {key:<20} {d / mib:8.1f} {f / mib:10.1f} {f / d:10.2f}")
    d, f = memory["ddp"]["peak_rss_mib"], memory["fsdp"]["peak_rss_mib"]
    print(f"  {'peak RSS (process)':<20} {d:8.1f} {f:10.1f} {f / d:10.2f}")
    env = child_env(
        {"BENCH_MODE": "speed", "BENCH_ROUNDS": str(args.rounds), "BENCH_STEPS": str(args.steps)}
    )
    times = run_job(script, 2, env, PREFIX, timeout=1200)["ms_per_step"]
    print("ms/step by round:", json.dumps({k: [round(v, 1) for v in t] for k, t in times.items()}))
    best = {k: min(t) for k, t in times.items()}
    paired = [f / h for f, h in zip(times["fsdp"], times["hand_fsdp"], strict=True)]
    print(
        f"best ms/step: hand FSDP2 {best['hand_fsdp']:.1f}, fastdist fsdp {best['fsdp']:.1f}, "
        f"fastdist ddp {best['ddp']:.1f}"
    )
    print(
        f"fsdp / hand FSDP2 (paired per round): median {statistics.median(paired):.3f} "
        f"({min(paired):.3f}..{max(paired):.3f}), best/best {best['fsdp'] / best['hand_fsdp']:.3f}"
    )
    print(f"fsdp / ddp (best/best): {best['fsdp'] / best['ddp']:.3f}")


if __name__ == "__main__":
    worker() if "BENCH_MODE" in os.environ else main()
