"""A user's training script for ``python -m fastdist check-resume``: ``resume_script.py
[--unresumable] [--small]``.

It trains a small MLP on fixed random data for 2 epochs (16 updates each; ``--small``: 2).
``--unresumable`` adds a callback that nudges ``head.bias`` after every update by a number from
Python's ``random``, seeded once per process and never saved: a resumed run draws the first
numbers again, so it ends elsewhere.
"""

from __future__ import annotations

import random
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import fastdist
from fastdist import DistTrainer
from fastdist.callbacks import Callback


class Nudge(Callback):
    """After every update, adds a number drawn from an unsaved generator to ``head.bias``."""

    def __init__(self) -> None:
        self.draws = random.Random(0)  # restarts from 0 in every process: not resumable

    def on_step_end(self) -> None:
        with torch.no_grad():
            self.trainer.model.head.bias.add_(self.draws.random() * 1e-3)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def main() -> None:
    fastdist.set_seed(1)
    x = torch.randn(
        16 if "--small" in sys.argv else 128, 8, generator=torch.Generator().manual_seed(0)
    )
    model = Net()
    trainer = DistTrainer(
        TensorDataset(x, x.sum(dim=1, keepdim=True)),
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        loss=nn.MSELoss(),
        callbacks_all=[Nudge()] if "--unresumable" in sys.argv else [],
        batch_size_per_gpu=8,
        n_epochs=2,
        use_tqdm=False,
        save_path="save",  # check-resume replaces it with its own
    )
    trainer.train()
    raise SystemExit("check-resume ends the process before train() returns")


if __name__ == "__main__":
    main()
