"""``JSONLogCallback``: the earlier spelling of ``DistTrainer(loggers=[JsonLogger()])``."""

from __future__ import annotations

import os

from fastdist.callbacks.run_log import RunLogCallback
from fastdist.loggers import JsonLogger


class JSONLogCallback(RunLogCallback):
    """Append the run's record to a JSON Lines file (see :class:`~fastdist.loggers.JsonLogger`
    for the records); ``DistTrainer(loggers=[JsonLogger(path)])`` is the newer spelling.

    Args:
        path: the file to append to; default ``log.jsonl`` in the trainer's ``save_path``,
            else in the current directory.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.logger = JsonLogger(path)
        super().__init__([self.logger])
