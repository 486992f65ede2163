"""Worker for tests/test_json_log.py: a tiny DistTrainer run logged by JSONLogCallback.

Usage (under torchrun or as a plain process)::

    json_log_worker.py OUT_DIR [--n-train N] [--n-epochs E] [--print-every P] [--validate-every V]

Trains a Linear classifier on random data with ``save_path=OUT_DIR/save`` and
``JSONLogCallback()`` in ``callbacks_master``, so the log goes to the default
``OUT_DIR/save/log.jsonl``. Rank 0 writes the trainer's result to ``OUT_DIR/result.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset
from workers.ending import exit_now

import fastdist
from fastdist import AccuracyMetric, CrossEntropyLoss, DistTrainer
from fastdist.callbacks.json_log import JSONLogCallback


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.fc(x)}


def dataset(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--n-train", type=int, default=80)
    parser.add_argument("--n-epochs", type=int, default=2)
    parser.add_argument("--print-every", type=int, default=2)
    parser.add_argument("--validate-every", type=int, default=-1)
    args = parser.parse_args()
    out = Path(args.out)

    fastdist.set_seed(0)
    model = Linear()
    trainer = DistTrainer(
        train_data=dataset(args.n_train, 0),
        dev_data=dataset(30, 1),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=CrossEntropyLoss(pred="pred", target="target"),
        metrics=AccuracyMetric(pred="pred", target="target"),
        callbacks_master=[JSONLogCallback()],
        batch_size_per_gpu=8,
        n_epochs=args.n_epochs,
        print_every=args.print_every,
        validate_every=args.validate_every,
        save_path=str(out / "save"),
        use_tqdm=False,
    )
    result = trainer.train()
    if trainer.is_master:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    exit_now()
