"""``TensorBoardLogger``: the run's scalars as TensorBoard event files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastdist.checks import check_number, check_path, describe
from fastdist.loggers.backend import Logger, RunContext, Scalar

MISSING_TENSORBOARD = (
    "TensorBoardLogger needs tensorboard, which is not installed: "
    'pip install tensorboard (or pip install "fastdist[tensorboard]")'
)


class TensorBoardLogger(Logger):
    """Write the scalars of ``log.jsonl`` (``loss``, ``lr``, ``dev/<key>``...) against
    ``global_step``, and the run's options as a text table ``options``.

    tensorboard is imported when training starts (``pip install fastdist[tensorboard]``).
    The writer is flushed after every evaluation and closed when training ends or raises. A
    resumed run writes to the same directory and drops the events after its resume step.

    Args:
        log_dir: directory of the event files; default ``<save_path>/tensorboard``, else
            ``runs``. View them with ``tensorboard --logdir LOG_DIR``. Two backends of one
            trainer may not write the same directory (refused when it is built).
        hparams: more options to record (e.g. the script's arguments).
        flush_secs: how often the writer flushes on its own, in seconds.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        hparams: Mapping[str, Any] | None = None,
        flush_secs: int = 30,
    ) -> None:
        self.log_dir = check_path("TensorBoardLogger(log_dir)", log_dir)
        if hparams is not None and not isinstance(hparams, Mapping):
            raise TypeError(
                f"TensorBoardLogger(hparams) must be a dict or None, got {describe(hparams)}"
            )
        check_number("TensorBoardLogger(flush_secs)", flush_secs, 0, inclusive=False)
        self.extra_hparams = dict(hparams or {})
        self.flush_secs = flush_secs
        self.writer: Any = None
        self.step = 0  # where training starts

    def destination(self, run: RunContext) -> str:
        return os.path.abspath(self.log_dir or run.under_save_path("tensorboard", "runs"))

    def open(self, run: RunContext) -> None:
        try:  # optional dependency, imported only when used
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"{MISSING_TENSORBOARD} ({exc})") from exc
        log_dir = self.destination(run)
        os.makedirs(log_dir, exist_ok=True)
        self.writer = SummaryWriter(
            log_dir=log_dir,
            # A resume drops what a killed run wrote after its checkpoint (steps > run.step).
            purge_step=run.step + 1 if run.step > 0 else None,
            flush_secs=self.flush_secs,
        )
        self.step = run.step

    def write(self, record: Mapping[str, Any]) -> None:
        super().write(record)
        if record["kind"] == "eval":
            self.writer.flush()

    def log_options(self, options: dict[str, Scalar]) -> None:
        values = {**options, **{k: str(v) for k, v in self.extra_hparams.items()}}
        rows = "\n".join(f"| {k} | {v} |" for k, v in values.items())
        self.writer.add_text("options", f"| name | value |\n|---|---|\n{rows}", self.step)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
