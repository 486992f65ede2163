"""``TensorBoardCallback``: the earlier spelling of ``loggers=[TensorBoardLogger(...)]``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastdist.callbacks.run_log import RunLogCallback
from fastdist.loggers import TensorBoardLogger


class TensorBoardCallback(RunLogCallback):
    """Write the run's scalars for TensorBoard (see :class:`~fastdist.loggers.TensorBoardLogger`);
    ``DistTrainer(loggers=[TensorBoardLogger(log_dir)])`` is the newer spelling.

    Args:
        log_dir: directory of the event files (created if missing).
        hparams: more options to record (e.g. the script's arguments).
        flush_secs: how often the writer flushes on its own, in seconds.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] = "runs",
        hparams: Mapping[str, Any] | None = None,
        flush_secs: int = 30,
    ) -> None:
        self.logger = TensorBoardLogger(log_dir, hparams, flush_secs)
        super().__init__([self.logger])
