"""Tensor-parallel benchmark: ms/step of ``FSDP(tp=2)`` on a 2x2 mesh (4 processes, CPU, gloo)
against a hand-written torchtitan-style 2-D loop (``init_device_mesh``, ``parallelize_module``
per block, ``fully_shard`` per block and on the root, ``DistributedSampler`` over
``dp_shard``), on an MLP of residual blocks (up colwise, down rowwise).

Run from the repository root::

    python benchmarks/tp.py [--rounds 3] [--steps 10]

One torchrun job times both loops paired per round, each on a fresh model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import child_env, run_job  # noqa: E402
from benchmarks.fsdp import StepClock  # noqa: E402
from fastdist import DistTrainer, get_rank  # noqa: E402
from fastdist.strategies import FSDP  # noqa: E402

WIDTH, BLOCKS, DIM, CLASSES, BATCH, DP, TP = 512, 8, 64, 10, 32, 2, 2
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
PREFIX = "TP-BENCH "


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def data(steps: int) -> TensorDataset:
    n = (steps + 1) * BATCH * DP  # +1: the first step is not timed
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, DIM, generator=gen), torch.randint(CLASSES, (n,)))


def run_trainer(steps: int) -> float:
    model = Model()
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
        strategy=FSDP(tp=TP, tp_plan=PLAN),
    )
    trainer.train(resume=False)
    return (clock.end - clock.start) / steps * 1000


def run_hand(steps: int) -> float:
    """The 2-D loop a user would write after torchtitan: TP per block, then FSDP2."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = Model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dataset = data(steps)
    sampler = DistributedSampler(dataset, DP, mesh.get_local_rank("dp"))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    start = 0.0
    for i, (x, y) in enumerate(loader):
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            start = time.perf_counter()
    return (time.perf_counter() - start) / steps * 1000


def worker() -> None:
    rounds, steps = int(os.environ["BENCH_ROUNDS"]), int(os.environ["BENCH_STEPS"])
    dist.init_process_group("gloo")
    times: dict[str, list[float]] = {"hand": [], "fastdist": []}
    for _ in range(rounds):
        times["hand"].append(run_hand(steps))
        times["fastdist"].append(run_trainer(steps))
    if get_rank() == 0:
        print(PREFIX + json.dumps({"ms_per_step": times}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    params = sum(p.numel() for p in Model().parameters())
    print(f"model: {params / 1e6:.1f}M parameters, AdamW, batch {BATCH} per data shard, 2x2 mesh")
    env = child_env({"BENCH_ROUNDS": str(args.rounds), "BENCH_STEPS": str(args.steps)})
    times = run_job(os.path.abspath(__file__), DP * TP, env, PREFIX, timeout=1200)["ms_per_step"]
    print("ms/step by round:", json.dumps({k: [round(v, 1) for v in t] for k, t in times.items()}))
    paired = [f / h for f, h in zip(times["fastdist"], times["hand"], strict=True)]
    best = {k: min(t) for k, t in times.items()}
    print(
        f"fastdist / hand 2-D (paired per round): {[round(r, 3) for r in paired]}, "
        f"best/best {best['fastdist'] / best['hand']:.3f}"
    )


if __name__ == "__main__":
    worker() if "BENCH_ROUNDS" in os.environ else main()
