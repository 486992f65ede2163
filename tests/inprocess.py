"""A tiny one-process trainer for in-process tests of logging callbacks (no process group)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fastdist import AccuracyMetric, CrossEntropyLoss, DistTrainer
from fastdist.callbacks import Callback


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.fc(x)}


def tiny_data() -> TensorDataset:
    """The 24 samples of 4 features (class: the first one's sign) that ``make_trainer`` uses."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long())


def make_trainer(callback: Callback, **kwargs: Any) -> DistTrainer:
    """24 samples, batch 4 (6 updates per epoch), ``callback`` in callbacks_master."""
    data = tiny_data()
    model = Linear()
    options: dict[str, Any] = {
        "train_data": data,
        "dev_data": data,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.05),
        "loss": CrossEntropyLoss(),
        "metrics": AccuracyMetric(),
        "callbacks_master": [callback],
        "batch_size_per_gpu": 4,
        "print_every": 2,
        "use_tqdm": False,
        "device": "cpu",  # on any machine
    }
    options.update(kwargs)
    return DistTrainer(**options)
