"""``WandbLogger``: the run in Weights & Biases (online, or offline with no account)."""

from __future__ import annotations

import os
from typing import Any

from fastdist.loggers.backend import Logger, RunContext, Scalar


class WandbLogger(Logger):
    """Log the options as the run's config and the scalars of ``log.jsonl`` at the same steps.

    wandb is imported when training starts (``pip install fastdist[wandb]``). A resumed run
    continues the same W&B run: its id is kept in the checkpoint.

    Args:
        project: the W&B project; default wandb's (``WANDB_PROJECT``...).
        mode: ``"online"``, ``"offline"`` (files only; ``wandb sync`` uploads them later) or
            ``"disabled"``; default wandb's (``WANDB_MODE``).
        name: the run's display name.
        dir: where wandb writes its files (``<dir>/wandb/...``); default the trainer's
            ``save_path``, else wandb's default (``WANDB_DIR`` or the current directory).
    """

    def __init__(
        self,
        project: str | None = None,
        mode: str | None = None,
        name: str | None = None,
        dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.project, self.mode, self.name = project, mode, name
        self.dir = None if dir is None else os.fspath(dir)
        self.run_id: str | None = None
        self.run: Any = None

    def open(self, run: RunContext) -> None:
        try:  # optional dependency, imported only when used
            import wandb
        except ImportError as exc:
            raise ImportError(f'{exc}: pip install "fastdist[wandb]" (or wandb)') from exc

        directory = self.dir or run.save_path
        if directory:
            os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            name=self.name,
            mode=self.mode,  # type: ignore[arg-type]
            dir=directory,
            id=self.run_id,
            resume="allow" if self.run_id else None,
            settings=wandb.Settings(console="off"),  # the trainer's output stays as it is
        )
        self.run_id = self.run.id

    def log_options(self, options: dict[str, Scalar]) -> None:
        self.run.config.update(options, allow_val_change=True)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None

    def state_dict(self) -> dict[str, Any]:
        return {} if self.run_id is None else {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state["run_id"]
