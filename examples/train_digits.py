"""Train a digit classifier on scikit-learn's bundled 8x8 digits, on every process of the job.

    torchrun --nproc-per-node=2 examples/train_digits.py      # 2 processes (CPU: gloo)
    python examples/train_digits.py                           # 1 process
    python -m fastdist ft --groups 2 examples/train_digits.py -- --fault-tolerant  # torchft

The data ships inside scikit-learn (no download). Rank 0 builds a tensor cache first while the
other ranks wait (``rank_zero_first``), then every rank reads the cache.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import Dataset

import fastdist
from fastdist import AccuracyMetric, CrossEntropyLoss, DistTrainer, logger, rank_zero_first
from fastdist.callbacks import FitlogCallback, GradientClipCallback, WarmupCallback
from fastdist.strategies import DDP


class Digits(Dataset):
    """Samples as dicts: ``x`` (64 pixel values in [0, 1]) and ``target`` (the digit)."""

    def __init__(self, x: torch.Tensor, target: torch.Tensor) -> None:
        self.x, self.target = x, target

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "target": self.target[i]}


class Classifier(nn.Module):
    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.net(x)}  # the batch field "x" is matched to this parameter


def build_or_load_cached(cache_dir: str) -> tuple[Digits, Digits]:
    """Split the digits 1497/300 once and cache the tensors; later calls just load them."""
    path = os.path.join(cache_dir, "digits.pt")
    if not os.path.exists(path):
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        split = {"train": order[300:], "dev": order[:300]}
        cache = {name: (x[idx], y[idx]) for name, idx in split.items()}
        os.makedirs(cache_dir, exist_ok=True)
        torch.save(cache, path + ".tmp")
        os.replace(path + ".tmp", path)  # readers never see a half-written cache
        logger.info("cached %d train / %d dev digits in %s", 1497, 300, path)
    cache = torch.load(path, weights_only=True)
    return Digits(*cache["train"]), Digits(*cache["dev"])


def log_best(result: dict) -> None:
    """Log the best dev accuracy of ``trainer.train()``'s result, when, and how long it took."""
    logger.info(
        "best dev accuracy %.4f at epoch %d (%d updates, %.1f s)",
        result["best_eval"]["acc"],
        result["best_epoch"],
        result["steps"],
        result["seconds"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size-per-gpu", type=int, default=32)
    parser.add_argument("--update-every", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--cache-dir", default="cache")
    parser.add_argument("--save-path", default="save")
    parser.add_argument("--log-dir", default="logs")
    parser.add_argument("--fault-tolerant", action="store_true", help="torchft replica groups")
    args = parser.parse_args()

    fastdist.set_seed(42)
    with rank_zero_first():
        train_data, dev_data = build_or_load_cached(args.cache_dir)
    model = Classifier()
    trainer = DistTrainer(
        train_data=train_data,
        dev_data=dev_data,
        model=model,
        loss=CrossEntropyLoss(pred="pred", target="target"),
        metrics=AccuracyMetric(pred="pred", target="target"),
        metric_key="acc",
        optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
        strategy=DDP(fault_tolerant=args.fault_tolerant),
        callbacks_all=[WarmupCallback(warmup=0.1, schedule="linear"), GradientClipCallback(1.0)],
        callbacks_master=[FitlogCallback(log_dir=args.log_dir)],
        batch_size_per_gpu=args.batch_size_per_gpu,
        update_every=args.update_every,
        n_epochs=args.epochs,
        print_every=10,
        use_tqdm=True,
        save_path=args.save_path,
    )
    log_best(trainer.train())


if __name__ == "__main__":
    main()
