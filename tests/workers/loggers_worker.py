"""Worker for tests/test_loggers.py: a tiny DistTrainer run written to every backend.

Usage (under torchrun or as a plain process)::

    loggers_worker.py OUT_DIR [--kill-at STEP] [--failing]

Trains a Linear classifier on random data (80 samples, 3 epochs, loss logged every 2
updates, checkpoints every 5) with ``save_path=OUT_DIR/save`` and the backends JsonLogger
(the default), TensorBoardLogger, MLflowLogger (its default SQLite store in save_path),
WandbLogger (offline) and FitlogLogger. ``--failing`` adds a backend whose writes raise
``OSError`` (a full disk); ``--kill-at STEP`` makes every rank SIGKILL itself after update
STEP. Rank 0 writes the trainer's result to ``OUT_DIR/result.json``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
from pathlib import Path

import torch
from json_log_worker import Linear, dataset

import fastdist
from fastdist import AccuracyMetric, CrossEntropyLoss, DistTrainer
from fastdist.callbacks import Callback
from fastdist.loggers import FitlogLogger, Logger, MLflowLogger, TensorBoardLogger, WandbLogger


class DiskFull(Logger):
    """A backend on a full disk: every write raises."""

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


class KillAt(Callback):
    """SIGKILL this process after update ``step`` (on every rank: a hard crash of the job)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--failing", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)

    fastdist.set_seed(0)
    model = Linear()
    loggers = [
        TensorBoardLogger(),
        MLflowLogger(experiment="loggers-test", run_name="tiny"),
        WandbLogger(project="loggers-test", mode="offline"),
        FitlogLogger(),
    ]
    trainer = DistTrainer(
        train_data=dataset(80, 0),
        dev_data=dataset(30, 1),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=CrossEntropyLoss(pred="pred", target="target"),
        metrics=AccuracyMetric(pred="pred", target="target"),
        callbacks_all=[KillAt(args.kill_at)] if args.kill_at else [],
        loggers=[*loggers, DiskFull()] if args.failing else loggers,
        batch_size_per_gpu=8,
        n_epochs=3,
        print_every=2,
        checkpoint_every=5,
        save_path=str(out / "save"),
        use_tqdm=False,
    )
    result = trainer.train()
    if trainer.is_master:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
