"""Benchmark workloads: models and synthetic data, built identically for both training loops.

This module imports torch only (never fastdist), so the hand-written loop's process does not
pay for importing fastdist and its peak RSS is that of a plain torch script.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

SEED = 1234  # model initialisation (torch.manual_seed before the model is built)
DATA_SEED = 4321  # synthetic inputs and labels (a private torch.Generator)
SAMPLER_SEED = 0  # DistributedSampler seed in both loops (fastdist's default ``seed=0``)
LR = 1e-3


@dataclass(frozen=True)
class Workload:
    """What one benchmark case trains: model kind, batch, accumulation and run length."""

    name: str
    model: str  # "mlp" or "transformer"
    batch_size: int  # per process
    update_every: int
    steps: int  # timed optimizer updates (approximately; rounded up to whole epochs)
    warmup: int  # optimizer updates before the timer starts
    epochs: int  # the run is split into this many epochs (exercises set_epoch)
    count_comm: bool  # register the counting DDP comm hook


WORKLOADS: dict[str, Workload] = {
    "tiny": Workload("tiny", "mlp", 32, 1, steps=1000, warmup=100, epochs=4, count_comm=False),
    "medium": Workload(
        "medium", "transformer", 16, 1, steps=60, warmup=10, epochs=2, count_comm=False
    ),
    "accumulation": Workload(
        "accumulation", "mlp", 32, 4, steps=250, warmup=40, epochs=4, count_comm=True
    ),
}


def plan(workload: Workload, nproc: int, steps: int | None = None) -> tuple[int, int, int]:
    """Return ``(epochs, updates_per_epoch, dataset_size)`` for ``warmup + steps`` updates.

    The dataset size is a whole number of global batches, so every micro-batch is full, no
    sampler padding occurs and every optimizer update averages the same number of samples.
    """
    total = workload.warmup + (workload.steps if steps is None else steps)
    per_epoch = -(-total // workload.epochs)
    size = per_epoch * workload.update_every * workload.batch_size * nproc
    return workload.epochs, per_epoch, size


class MLP(nn.Module):
    """64-256-256-10 multi-layer perceptron (overhead-dominated)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TransformerClassifier(nn.Module):
    """Token embedding + learned positions, 2-layer encoder, mean-pool, 10-way classifier."""

    def __init__(
        self,
        vocab: int = 1000,
        seq_len: int = 64,
        d_model: int = 128,
        nhead: int = 4,
        layers: int = 2,
        classes: int = 10,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(tokens) + self.pos)
        return self.head(hidden.mean(dim=1))


VOCAB, SEQ_LEN, CLASSES = 1000, 64, 10


def build_model(workload: Workload) -> nn.Module:
    """Build the workload's model from the fixed seed (the same weights in every process)."""
    torch.manual_seed(SEED)
    return MLP() if workload.model == "mlp" else TransformerClassifier(VOCAB, SEQ_LEN)


def build_data(workload: Workload, size: int) -> TensorDataset:
    """Synthetic ``(input, label)`` samples drawn from :data:`DATA_SEED`."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    if workload.model == "mlp":
        x = torch.randn(size, 64, generator=gen)
    else:
        x = torch.randint(0, VOCAB, (size, SEQ_LEN), generator=gen)
    y = torch.randint(0, CLASSES, (size,), generator=gen)
    return TensorDataset(x, y)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the same hyper-parameters in both loops."""
    return torch.optim.AdamW(model.parameters(), lr=LR)
