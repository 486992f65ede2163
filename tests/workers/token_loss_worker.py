"""Variable-length sequences, a ``(sum, count)`` loss: ``token_loss_worker.py OUT UPDATE_EVERY``.

Each sample has 1 to 9 real tokens, so micro-batches (and ranks) hold different token counts;
rank 0 writes the final parameters to OUT.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from torch.utils.data import Dataset
from workers.ending import exit_now

import fastdist
from fastdist import DistTrainer


class Sequences(Dataset):
    """``n`` sequences of 9 positions, 1 to 9 of them real (``mask``); the target is each
    position's sum (``squash``: its tanh), 0 past the end."""

    def __init__(self, n: int = 64, seed: int = 3, squash: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.squash = squash
        self.lengths = torch.randint(1, 10, (n,), generator=g).tolist()
        self.x = torch.randn(n, 9, 3, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.arange(9) < self.lengths[i]
        target = self.x[i].sum(-1)
        return {
            "x": self.x[i],
            "mask": mask,
            "target": (target.tanh() if self.squash else target) * mask,
        }


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 1).double()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.proj(x).squeeze(-1)}


def token_loss(output: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared error summed over the real tokens, and their number."""
    mask = batch["mask"]
    return ((output["pred"] - batch["target"]) ** 2 * mask).sum(), mask.sum()


def main(out: str, update_every: int) -> None:
    fastdist.set_seed(0)
    model = Tagger()
    trainer = DistTrainer(
        Sequences(),
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        loss=token_loss,
        batch_size_per_gpu=4,
        update_every=update_every,
        n_epochs=2,
        use_tqdm=False,
    )
    trainer.train()
    if fastdist.get_rank() == 0:
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        with open(out, "w") as f:
            json.dump(params, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    exit_now()
