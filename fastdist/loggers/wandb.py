"""``WandbLogger``: the run in Weights & Biases (online, or offline with no account)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from fastdist.checks import check_choice, check_optional_str, check_path
from fastdist.loggers.backend import Logger, RunContext, Scalar
from fastdist.logging import logger

MODES = ("online", "offline", "disabled")


class WandbLogger(Logger):
    """Log the options as the run's config and the scalars of ``log.jsonl`` at the same steps.

    wandb is imported when training starts (``pip install fastdist[wandb]``). Each
    ``train()`` starts a new W&B run, except a resume (the run id is kept in the checkpoint;
    a run is continued only when it comes from there):

    * a plain resume continues the same run (``resume="allow"``);
    * a rollback (a resume from a checkpoint older than the newest one, or one on another
      number of data shards than the checkpoint's: the steps after it are then not trained
      again identically) starts a new run
      forked from the old one at the resumed step S (``fork_from="<old id>?_step=S"``: W&B
      gives it the old run's history up to S), with ``fastdist/continues`` (the old id) and
      ``fastdist/continues_from_step`` (S) in its config. The old run keeps the discarded
      branch; unlike MLflow's, it is not tagged (an offline run's files cannot be edited),
      and a plain resume from a checkpoint written before the rollback continues the old run.

    wandb writes from a process of its own, whose write errors training never sees: at the
    end, the backend warns (naming the directory) when the run's ``.wandb`` file is missing
    or empty, or the disk holding it has less than 64 KiB free, which is when a full disk may
    have cost data (wandb's ``finish`` itself reports nothing). A disk that filled and
    emptied again meanwhile goes unnoticed. Offline, the steps since wandb's last flush are
    lost when rank 0 is killed with ``SIGKILL`` (``log.jsonl`` holds them). One
    ``WandbLogger`` per trainer: wandb keeps one run per process.

    Args:
        project: the W&B project; default wandb's (``WANDB_PROJECT``...).
        mode: ``"online"``, ``"offline"`` (files only; ``wandb sync`` uploads them later) or
            ``"disabled"``; default wandb's (``WANDB_MODE``).
        name: the run's display name.
        dir: where wandb writes its files (``<dir>/wandb/...``); default the trainer's
            ``save_path``, else wandb's default (``WANDB_DIR`` or the current directory).
    """

    one_per_process = True  # wandb.init returns the process's run while it is open

    def __init__(
        self,
        project: str | None = None,
        mode: str | None = None,
        name: str | None = None,
        dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if mode is not None:
            check_choice("WandbLogger(mode)", mode, MODES)
        self.project = check_optional_str("WandbLogger(project)", project, "'my-project'")
        self.mode = mode
        self.name = check_optional_str("WandbLogger(name)", name, "'baseline'")
        self.dir = check_path("WandbLogger(dir)", dir)
        self.run_id: str | None = None  # the run being written (kept in checkpoints)
        self.resume_id: str | None = None  # from a checkpoint: the run the next open continues
        self.run: Any = None

    def open(self, run: RunContext) -> None:
        try:  # optional dependency, imported only when used
            import wandb
        except ImportError as exc:
            raise ImportError(f'{exc}: pip install "fastdist[wandb]" (or wandb)') from exc

        directory = self.dir or run.save_path
        if directory:
            os.makedirs(directory, exist_ok=True)
        resumed, self.resume_id = self.resume_id, None
        how: dict[str, Any] = {}
        if resumed is not None and run.rollback:
            how = {
                "fork_from": f"{resumed}?_step={run.step}",
                "config": {"fastdist/continues": resumed, "fastdist/continues_from_step": run.step},
            }
        elif resumed is not None:
            how = {"id": resumed, "resume": "allow"}
        self.run = wandb.init(
            project=self.project,
            name=self.name,
            mode=self.mode,  # type: ignore[arg-type]
            dir=directory,
            settings=wandb.Settings(console="off"),  # the trainer's output stays as it is
            **how,
        )
        self.run_id = self.run.id

    def log_options(self, options: dict[str, Scalar]) -> None:
        self.run.config.update(options, allow_val_change=True)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=1 if failed else 0)
            warn_if_lost(run)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.run_id is None else {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run_id = state["run_id"]
        if not isinstance(run_id, str):
            raise TypeError(f"the checkpoint's W&B run id is {run_id!r}, not a str")
        self.resume_id = run_id


#: Free space below which the disk holding a run's files counts as full.
FULL_BYTES = 2**16


def warn_if_lost(run: Any) -> None:
    """Warn, naming the directory, when a finished run's ``.wandb`` file is missing or empty,
    or the disk holding it is (nearly) full: wandb's own process may have lost data."""
    sync_file = getattr(run.settings, "sync_file", None)
    if run.settings.mode == "disabled" or not sync_file:
        return
    directory = os.path.dirname(sync_file)
    try:
        size, free = os.path.getsize(sync_file), shutil.disk_usage(directory).free
    except OSError as exc:
        problem = f"its file {sync_file} cannot be read ({exc})"
    else:
        if size > 0 and free >= FULL_BYTES:
            return
        problem = f"its file {sync_file} is empty" if size == 0 else "its disk is full"
    logger.warning(
        "WandbLogger: the W&B run %s may have lost data: %s; check the directory %s (wandb "
        "writes from a process of its own, whose errors training does not see)",
        run.id,
        problem,
        directory,
    )
