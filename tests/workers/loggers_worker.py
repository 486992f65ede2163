"""Worker for tests/test_loggers.py: a tiny DistTrainer run written to every backend.

Usage (under torchrun or as a plain process)::

    loggers_worker.py OUT_DIR [--kill-at STEP] [--failing] [--unreachable PORT] [--bad-state]
        [--locked DIR] [--rollback]

Trains a Linear classifier on random data (80 samples, 3 epochs, loss logged every 2
updates, checkpoints every 5) with ``save_path=OUT_DIR/save`` and the backends JsonLogger
(the default), TensorBoardLogger, MLflowLogger (its default SQLite store in save_path),
WandbLogger (offline) and FitlogLogger. ``--failing`` adds a backend whose writes raise
``OSError`` (a full disk); ``--unreachable PORT`` an MLflowLogger whose tracking server
(127.0.0.1:PORT) does not answer; ``--bad-state`` backends whose ``state_dict`` (``BadSave``)
or ``load_state_dict`` (``BadLoad``) raise; ``--kill-at STEP`` makes every rank SIGKILL itself
after update STEP. Rank 0 writes the trainer's result to ``OUT_DIR/result.json``.

Then, in the same processes: ``--locked DIR`` trains into the save_path DIR (which the test
holds locked), then with DIR as checkpoint_dir, and writes every rank's errors to
``OUT_DIR/locked-<rank>.txt``; ``--rollback``
trains a fresh run into ``OUT_DIR/rollback`` (MLflow in the save_path's store, W&B offline,
JSON; checkpoints at steps 10 and 15 kept), then rolls back to its step 10 on other data
(so the steps after 10 differ).
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
from workers.ending import exit_now

import fastdist
from fastdist import AccuracyMetric, CrossEntropyLoss, DistTrainer
from fastdist.callbacks import Callback
from fastdist.loggers import FitlogLogger, Logger, MLflowLogger, TensorBoardLogger, WandbLogger


class DiskFull(Logger):
    """A backend on a full disk: every write raises."""

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


class BadSave(Logger):
    """A backend whose state cannot be saved."""

    def state_dict(self) -> dict[str, int]:
        raise RuntimeError("state_dict broke")


class BadLoad(Logger):
    """A backend whose saved state cannot be restored."""

    def state_dict(self) -> dict[str, int]:
        return {"x": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise RuntimeError("load_state_dict broke")


class KillAt(Callback):
    """SIGKILL this process after update ``step`` (on every rank: a hard crash of the job)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(
    save: Path,
    loggers: list[Logger],
    data_seed: int = 0,
    kill_at: int = 0,
    checkpoint_dir: str = "",
) -> DistTrainer:
    fastdist.set_seed(0)
    model = Linear()
    return DistTrainer(
        train_data=dataset(80, data_seed),
        dev_data=dataset(30, 1),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=CrossEntropyLoss(pred="pred", target="target"),
        metrics=AccuracyMetric(pred="pred", target="target"),
        callbacks_all=[KillAt(kill_at)] if kill_at else [],
        loggers=loggers,
        batch_size_per_gpu=8,
        n_epochs=3,
        print_every=2,
        checkpoint_every=5,
        save_path=str(save),
        checkpoint_dir=checkpoint_dir or None,
        use_tqdm=False,
    )


def rollback(out: Path, store: Path) -> None:
    """A fresh run, then a rollback to its step 10 on other data (same save_path); MLflow
    writes to ``store`` (an existing one: a new one takes seconds to create)."""
    for seed, resume in ((0, "auto"), (2, str(out / "checkpoints" / "step-00000010.pt"))):
        loggers = [
            MLflowLogger(tracking_uri=f"sqlite:///{store}", experiment="rollback"),
            WandbLogger(project="rollback", mode="offline"),
        ]
        trainer(out, loggers, data_seed=seed).train(resume=resume)


def locked(out: Path, held: str) -> None:
    """Train into the save_path ``held`` (held by the test), then with another save_path and
    ``held`` as checkpoint_dir: every rank writes the errors it raised."""
    errors = []
    for save, checkpoint_dir in ((Path(held), ""), (out / "own", held)):
        try:
            trainer(save, [], checkpoint_dir=checkpoint_dir).train()
            errors.append("no error")
        except OSError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    (out / f"locked-{fastdist.get_rank()}.txt").write_text("\n".join(errors))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--failing", action="store_true")
    parser.add_argument("--unreachable", type=int, default=0)
    parser.add_argument("--bad-state", action="store_true")
    parser.add_argument("--locked", default="")
    parser.add_argument("--rollback", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)

    loggers = [
        TensorBoardLogger(),
        MLflowLogger(experiment="loggers-test", run_name="tiny"),
        WandbLogger(project="loggers-test", mode="offline"),
        FitlogLogger(),
    ]
    if args.failing:
        loggers.append(DiskFull())
    if args.unreachable:
        uri = f"http://127.0.0.1:{args.unreachable}"
        loggers.append(MLflowLogger(tracking_uri=uri, experiment="unreachable"))
    if args.bad_state:
        loggers += [BadSave(), BadLoad()]
    result = trainer(out / "save", loggers, kill_at=args.kill_at).train()
    if fastdist.is_master():
        (out / "result.json").write_text(json.dumps(result))
    if args.locked:
        locked(out, args.locked)
    if args.rollback:
        rollback(out / "rollback", out / "save" / "mlflow.db")


if __name__ == "__main__":
    main()
    exit_now()
