"""Part of tests/workers/tp_worker.py's worlds, and a worker of its own for
tests/test_estimate.py: :func:`fastdist.estimate_memory` against the peak memory a rank
measures while training the same configuration.

Usage (2 ranks under torchrun)::

    estimate_worker.py OUT_DIR

Writes ``OUT_DIR/rank<R>.json``: for a GRU language model, a conv net under activation
checkpointing and a mixture-of-experts net, under DDP and FSDP, the estimated and the measured
peak in bytes.

The peak measured: the parameters this rank holds once the trainer is built, plus the rise
of the resident memory over ``train()`` (``VmHWM`` after resetting it with
``/proc/self/clear_refs``, minus ``VmRSS`` before); the launch sets ``MALLOC_MMAP_THRESHOLD_``
so that freed tensors leave the resident memory at once. The torch packages fastdist imports
when first used are imported here first: their code is not the training's memory.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils.data import TensorDataset
from workers.ending import exit_now
from workers.trainer_worker import write_json

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
        return self.down(F.gelu(self.up(x)))


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


class GRULM(nn.Module):
    """A GRU language model: embedding, one GRU layer, a head over the vocabulary."""

    def __init__(self, vocab: int = 2000) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, 64)
        self.gru = nn.GRU(64, 256, batch_first=True)
        self.head = nn.Linear(256, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(x))[0])


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.first = nn.Conv2d(channels, channels, 3, padding=1)
        self.second = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(F.relu(self.first(F.relu(x))))


class ConvNet(nn.Module):
    """Residual conv blocks on 32x32 images (8 MiB per activation at 64 images)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(32) for _ in range(4))
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h.mean((2, 3)))


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


def wider_case(name: str) -> tuple[nn.Module, TensorDataset, int, bool]:
    """``name``'s model, data (4 micro-batches per rank at 2 ranks), micro-batch size and
    activation checkpointing."""
    gen = torch.Generator().manual_seed(0)
    if name == "gru":
        tokens = torch.randint(0, 2000, (32 * 8, 65), generator=gen)
        return GRULM(), TensorDataset(tokens[:, :-1], tokens[:, 1:]), 32, False
    if name == "conv":
        images = torch.randn(64 * 8, 3, 32, 32, generator=gen)
        labels = torch.randint(0, 10, (64 * 8,), generator=gen)
        return ConvNet(), TensorDataset(images, labels), 64, True
    x = torch.randn(2048 * 8, 16, generator=gen)
    return MoENet(), TensorDataset(x, (x[:, 0] > 0).long()), 2048, False


def compare_wider(name: str, strategy: str) -> dict[str, Any]:
    """Estimate, then train ``name``'s case under ``strategy`` at 2 ranks and measure."""
    model, data, batch_size, checkpointing = wider_case(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tuple(t[:batch_size] for t in data.tensors)
    settings = {"loss": CrossEntropyLoss(), "activation_checkpointing": checkpointing}
    estimate = estimate_memory(model, optimizer, batch, strategy, 2, **settings)
    trainer = DistTrainer(
        data,
        model,
        optimizer=optimizer,
        batch_size_per_gpu=batch_size,
        n_epochs=1,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
        **settings,
    )
    measured = held(trainer.model) + training_peak(trainer)
    return {"estimate": estimate.peak, "measured": measured}


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    compare_wider("moe", "ddp")  # warm-up: the first training of a process allocates for good
    results = {
        f"{name}-{strategy}": compare_wider(name, strategy)
        for name in ("gru", "conv", "moe")
        for strategy in ("ddp", "fsdp")
    }
    write_json(out, results)
    return 0


def compare(strategy: Any, world_size: int, data_shards: int, size: int = BATCH) -> dict[str, Any]:
    """Estimate, then train 2 updates (update_every=2) of micro-batches of ``size`` and
    measure; both in bytes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 16, generator=gen)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    model = Wide()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = CrossEntropyLoss()
    batch = (x[:size], data.tensors[1][:size])
    estimate = estimate_memory(
        model, optimizer, batch, strategy, world_size, loss=loss, update_every=2
    )
    trainer = DistTrainer(
        torch.utils.data.Subset(data, range(size * data_shards * 4)),
        model,
        optimizer=optimizer,
        loss=loss,
        batch_size_per_gpu=size,
        update_every=2,
        n_epochs=1,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
    )
    measured = held(trainer.model) + training_peak(trainer)
    peaks = [stage.peak for stage in estimate.stages]  # a pipeline's, stage by stage
    found = {"estimate": dataclasses.asdict(estimate), "peak": estimate.peak, "peaks": peaks}
    return {**found, "measured": measured}


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


if __name__ == "__main__":
    exit_now(main(sys.argv))
