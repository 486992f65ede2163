"""``JsonLogger``: the run as JSON Lines (``log.jsonl``), with no dependencies."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import IO, Any

from fastdist.checks import check_file_path
from fastdist.loggers.backend import Logger, RunContext, file_identity

DEFAULT_FILE_NAME = "log.jsonl"


class JsonLogger(Logger):
    """Append every record of a run to a JSON Lines file; ``fastdist plot`` draws it.

    The file is opened in append mode, so several runs (and the parts of a resumed run) may
    share one file, each starting with its ``"start"`` record. Every line is flushed when it is
    written. The records:

    * ``kind="start"``: ``start_time`` (local ISO 8601), ``world_size``, ``total_steps``,
      ``global_batch``, ``optimizer`` (its class), ``lr`` (its first group's) and ``config``
      (every :class:`~fastdist.DistTrainer` option);
    * ``kind="train"`` every ``print_every`` updates: ``loss`` (mean over all ranks since the
      previous one), ``lr`` (first parameter group), ``samples_per_s`` (the global batch times
      the updates since the previous ``"train"`` record, over the seconds since then spent
      outside evaluation), ``memory_mb`` (rank 0's peak: on its GPU, else the process's
      resident set) and ``ranks``: one dict per rank of its mean time per update since the
      previous one (``rank``, ``update_ms``, ``data_ms``, ``compute_ms``, ``collective_ms``;
      see :mod:`fastdist.trainer.timing`);
    * ``kind="eval"`` after every evaluation: ``is_better`` and every key of the result;
    * ``kind="end"``: ``best_eval``, ``best_epoch``, ``best_step``, ``steps``, ``seconds``;
      or ``kind="exception"`` (``error``) when training raises.

    Every record has ``step`` (``global_step``), ``epoch`` and ``time`` (seconds since
    training began). A non-finite loss is written as ``NaN``/``Infinity``, which Python's
    ``json`` reads back.

    Args:
        path: the file to append to; default ``log.jsonl`` in the trainer's ``save_path``,
            else in the current directory. Missing directories are created. Two backends
            of one trainer may not write the same file (refused when it is built).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path: str | None = check_file_path("JsonLogger(path)", path)
        self.file: IO[str] | None = None

    def destination(self, run: RunContext) -> str:
        path = self.path or run.under_save_path(DEFAULT_FILE_NAME, DEFAULT_FILE_NAME)
        return os.path.abspath(path)

    def open(self, run: RunContext) -> None:
        path = self.destination(run)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, record: Mapping[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, default=str) + "\n")
            self.file.flush()

    def close(self, failed: bool) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def writes_run_log(backends: list[Logger], save_path: str) -> bool:
    """Whether one of ``backends`` is a :class:`JsonLogger` writing the run's own log,
    ``save_path/log.jsonl`` (another path does not: that file is still written)."""
    run = RunContext(save_path, 0)
    log = file_identity(JsonLogger().destination(run))  # a hard link is the same file
    return any(
        isinstance(b, JsonLogger) and file_identity(b.destination(run)) == log for b in backends
    )
