"""Worker for tests/test_resume.py: train, die or get pre-empted, and resume with one command.

Usage (under torchrun, with or without restarts, or as a plain process)::

    resume_worker.py OUT_DIR CONFIG[,CONFIG...] [--tag TAG] [--checkpoint-every K] [--batch B]
        [--kill-at M --kill-how exit|sigkill]
        [--sigterm-at S --sigterm-rank all|R [--sigterm-again]]

Each CONFIG of :data:`CONFIGS` trains a float64 MLP with dropout (SGD with momentum, a
learning-rate callback) from a fixed seed with ``save_path=OUT_DIR/CONFIG``, so its checkpoints
go to ``OUT_DIR/CONFIG/checkpoints``. Files are named ``<TAG>-<restart>.rank<R>`` where
``<restart>`` is torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 without torchrun):

* ``.ids.jsonl``: one line ``{"epoch", "step", "ids", "loss"}`` per completed update (its
  sample ids and summed micro-batch losses), flushed at once, so it survives the process dying.
* ``.json``: the result (final parameters: this rank's shards and the whole model, the step
  training resumed at...) when ``train()`` returned, or ``{"exit_code", "step"}`` when it raised
  ``SystemExit`` (pre-emption).

``--kill-at M`` makes rank 1 die (``os._exit(1)`` or SIGKILL) before its ``M``-th micro-batch
(counted from 1 in this process) and ``--sigterm-at S`` sends SIGTERM to the chosen ranks after
update ``S``; both only on the first attempt (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a
restarted job runs the same command to the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from workers.ending import exit_from
from workers.trainer_worker import CLASSES, DIM, ToyData

from fastdist import DDP, Callback, CrossEntropyLoss, DistTrainer, get_rank
from fastdist.callbacks import LRSchedulerCallback, WarmupCallback

N_SAMPLES, BATCH, N_EPOCHS = 72, 4, 2  # 2 ranks: 36 samples = 9 micro-batches per epoch
HIDDEN = 16
KILL_RANK = 1


class Config(NamedTuple):
    update_every: int
    schedule: str  # of the learning rate: "warmup" (per update) or "epoch" (StepLR)
    strategy: Any
    dropout: float = 0.5
    keep: int = 3  # keep_checkpoints


CONFIGS: dict[str, Config] = {
    "plain": Config(1, "warmup", "ddp"),  # 9 updates per epoch on 2 ranks
    "accumulate": Config(2, "warmup", "ddp"),  # windows of 2 micro-batches, a short last: 5 updates
    "epoch-lr": Config(1, "epoch", "ddp"),  # StepLR stepped at every epoch end
    "fsdp": Config(2, "warmup", "fsdp"),  # as accumulate, sharded (DCP) checkpoints
    # As fsdp, every checkpoint kept, without dropout (its masks come from each rank's own
    # generator): a run resumed on another world size with the same global batch must end
    # where this one does, to float64 rounding.
    "fsdp-exact": Config(2, "warmup", "fsdp", dropout=0.0, keep=100),
    # PowerSGD compresses from update 11: its per-rank error feedback and Q matrices must resume.
    "powersgd": Config(1, "warmup", DDP(comm_hook="powersgd")),
    # Local SGD: after 4 updates, ranks step on their own and average every 4th update; each
    # rank's parameters and momentum between averagings must resume.
    "local-sgd": Config(1, "warmup", DDP(average_every=4)),
}


class DropNet(nn.Module):
    """A float64 MLP with dropout, so every resume must restore the random generators."""

    def __init__(self, dropout: float = 0.5, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.hidden = nn.Linear(DIM, hidden, dtype=torch.float64)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, CLASSES, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.hidden(x))))


def flat_params(model: nn.Module) -> list[float]:
    """All parameters of ``model`` (this rank's shards under FSDP) as one flat list."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().flatten() for p in local]).tolist()


def full_params(model: nn.Module) -> list[float]:
    """All parameters of ``model``, whole (FSDP's gathered: a collective), as one flat list."""
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().flatten() for p in full]).tolist()


def first_attempt() -> bool:
    """Whether this is not a restart by torchrun (faults are injected on the first only)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class IdLog(Callback):
    """Appends the sample ids and summed micro-batch losses of every completed update to
    ``path`` as a JSON line, flushed immediately."""

    def __init__(self, path: Path) -> None:
        self.file: IO[str] = open(path, "a")  # noqa: SIM115 - open for the whole run
        self.ids: list[int] = []
        self.loss = 0.0
        self.start_step: int | None = None
        self.rolled_back = False

    def on_train_begin(self) -> None:
        self.start_step = self.trainer.state.global_step
        self.rolled_back = self.trainer.state.rolled_back

    def on_epoch_begin(self) -> None:
        self.ids, self.loss = [], 0.0

    def on_batch_begin(self, batch: Any) -> None:
        self.ids += batch["idx"].tolist()

    def on_backward_begin(self, loss: Any) -> None:
        self.loss += loss.item()

    def on_step_end(self) -> None:
        state = self.trainer.state
        record = {"epoch": state.epoch, "step": state.global_step, "ids": self.ids}
        self.file.write(json.dumps(dict(record, loss=self.loss)) + "\n")
        self.file.flush()
        self.ids, self.loss = [], 0.0


class Faults(Callback):
    """Kills rank 1 before micro-batch ``kill_at``; sends SIGTERM after update ``sigterm_at``
    and, with ``again``, once more to rank 0 while it writes the checkpoint, which then takes
    2 s longer (this callback's state is asked for there, on rank 0)."""

    def __init__(
        self,
        kill_at: int | None = None,
        kill_how: str = "exit",
        sigterm_at: int | None = None,
        sigterm_rank: str = "all",
        again: bool = False,
    ) -> None:
        self.kill_at = kill_at
        self.kill_how = kill_how
        self.sigterm_at = sigterm_at
        self.sigterm_rank = sigterm_rank
        self.again = again
        self.micro_batches = 0

    def on_batch_begin(self, batch: Any) -> None:
        self.micro_batches += 1
        if self.micro_batches != self.kill_at or get_rank() != KILL_RANK:
            return
        if self.kill_how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(1)

    def on_step_end(self) -> None:
        if self.trainer.state.global_step != self.sigterm_at:
            return
        if self.sigterm_rank in ("all", str(get_rank())):
            os.kill(os.getpid(), signal.SIGTERM)

    def state_dict(self) -> dict[str, Any]:
        if self.again and self.trainer.state.global_step > (self.sigterm_at or 0):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)
        return {}


def build_trainer(
    config: str,
    save_path: Path,
    checkpoint_every: int = 1,
    callbacks: list[Callback] | None = None,
    batch: int = BATCH,
    callbacks_master: list[Callback] | None = None,
    n_epochs: int = N_EPOCHS,
    train_data: Any = None,
    hidden: int = HIDDEN,
    adamw: bool = False,
    frozen: bool = False,
    **options: Any,
) -> DistTrainer:
    """The trainer of ``config``, built from fixed seeds (the same in every attempt), on
    ``train_data`` (default ``ToyData(N_SAMPLES)``); ``options``: more DistTrainer arguments.
    ``hidden`` and ``adamw`` (instead of SGD) make another model and optimizer; ``frozen``
    freezes the first layer, and the optimizer holds the others only."""
    update_every, schedule, strategy, dropout, keep = CONFIGS[config]
    torch.manual_seed(1234)  # the model's init and the first dropout masks
    model = DropNet(dropout, hidden)
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    if adamw:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.2)
    if frozen:
        next(model.children()).requires_grad_(False)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trained, lr=0.2, momentum=0.9)
    if schedule == "warmup":
        lr_callback: Callback = WarmupCallback(warmup=0.3, schedule="linear")
    else:
        step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        lr_callback = LRSchedulerCallback(step_lr, interval="epoch")
    return DistTrainer(
        ToyData(N_SAMPLES) if train_data is None else train_data,
        model,
        optimizer,
        loss=CrossEntropyLoss(),
        callbacks_all=[lr_callback, *(callbacks or [])],
        callbacks_master=callbacks_master,
        batch_size_per_gpu=batch,
        n_epochs=n_epochs,
        update_every=update_every,
        print_every=2,
        save_path=str(save_path),
        use_tqdm=False,
        device="cpu",
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep,
        strategy=strategy,
        **options,
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def run(config: str, args: argparse.Namespace) -> None:
    """Train ``config`` once, recording ids and the result (or the pre-emption exit code)."""
    directory = Path(args.out) / config
    directory.mkdir(parents=True, exist_ok=True)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"{args.tag}-{restart}.rank{get_rank()}"
    ids = IdLog(directory / f"{prefix}.ids.jsonl")
    faults = Faults()
    if first_attempt():
        faults = Faults(
            args.kill_at, args.kill_how, args.sigterm_at, args.sigterm_rank, args.sigterm_again
        )
    # The same callbacks in every attempt: a checkpoint holds one state per callback.
    trainer = build_trainer(config, directory, args.checkpoint_every, [ids, faults], args.batch)
    try:
        result = trainer.train()  # resume="auto": the same command resumes
    except SystemExit as exc:
        record = {"exit_code": exc.code, "step": trainer.state.global_step}
        write_json(directory / f"{prefix}.json", record)
        raise
    finally:
        ids.file.close()
    write_json(
        directory / f"{prefix}.json",
        {
            "final": flat_params(trainer.model),
            "full": full_params(trainer.model),
            "start_step": ids.start_step,
            "rolled_back": ids.rolled_back,
            "steps": result["steps"],
            "total_steps": trainer.state.total_steps,
            "world_size": trainer.world_size,
        },
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("configs", help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--tag", default="run")
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--batch", type=int, default=BATCH, help="batch_size_per_gpu")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-how", choices=("exit", "sigkill"), default="exit")
    parser.add_argument("--sigterm-at", type=int, default=None)
    parser.add_argument("--sigterm-rank", default="all")
    parser.add_argument("--sigterm-again", action="store_true")
    args = parser.parse_args(argv[1:])
    for config in args.configs.split(","):
        run(config, args)
    return 0


if __name__ == "__main__":
    exit_from(lambda: main(sys.argv))
