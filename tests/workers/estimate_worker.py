"""Part of tests/workers/tp_worker.py's worlds: :func:`fastdist.estimate_memory` against the
peak memory a rank measures while training the same configuration.

The peak measured: the parameters this rank holds once the trainer is built, plus the rise
of the resident memory over ``train()`` (``VmHWM`` after resetting it with
``/proc/self/clear_refs``, minus ``VmRSS`` before); the launch sets ``MALLOC_MMAP_THRESHOLD_``
so that freed tensors leave the resident memory at once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from fastdist import CrossEntropyLoss, DistTrainer, estimate_memory

WIDTH, BLOCKS, BATCH, N = 1024, 6, 64, 2048
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Wide(nn.Module):
    """An MLP of residual blocks: 4 MiB of parameters each, a few MiB of activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoE(nn.Module):
    """A mixture-of-experts layer: each token to its top expert (an ``nn.ModuleList``)."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        top = weights.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = top == i
            out[chosen] = expert(x[chosen]) * weights[chosen][:, i : i + 1]
        return x + out


class MoENet(nn.Module):
    """Layers of experts: the blocks are the layers, each holding a list of experts."""

    def __init__(self, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(MoE(width) for _ in range(layers))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def training_peak(trainer: DistTrainer) -> int:
    """How far the resident memory's high-water mark rises over ``trainer.train()``."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_bytes("VmRSS")
    trainer.train()
    return status_bytes("VmHWM") - before


def held(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (DTensors: its shard)."""
    local = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local)


def compare(strategy: Any, world_size: int, data_shards: int) -> dict[str, Any]:
    """Estimate, then train 2 updates (update_every=2) and measure; both in bytes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 16, generator=gen)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    model = Wide()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = CrossEntropyLoss()
    batch = (x[:BATCH], data.tensors[1][:BATCH])
    estimate = estimate_memory(
        model, optimizer, batch, strategy, world_size, loss=loss, update_every=2
    )
    trainer = DistTrainer(
        torch.utils.data.Subset(data, range(BATCH * data_shards * 4)),
        model,
        optimizer=optimizer,
        loss=loss,
        batch_size_per_gpu=BATCH,
        update_every=2,
        n_epochs=1,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
    )
    measured = held(trainer.model) + training_peak(trainer)
    return {"estimate": dataclasses.asdict(estimate), "peak": estimate.peak, "measured": measured}


def setup() -> dict[str, Any]:
    """``python -m fastdist estimate tests/workers/estimate_worker.py:setup``."""
    model = Wide()
    x = torch.randn(BATCH, 16)
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "batch": (x, (x[:, 0] > 0).long()),
        "loss": CrossEntropyLoss(),
        "tp_plan": PLAN,
    }
