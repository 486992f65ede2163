"""``FitlogLogger``: the run in fitlog (https://github.com/fastnlp/fitlog)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastdist.checks import check_path
from fastdist.loggers.backend import Logger, RunContext, Scalar, scalars


class FitlogLogger(Logger):
    """Log the options as hyper-parameters, the training loss, the other scalars as metrics
    and every better evaluation as the best result.

    fitlog is imported when training starts (``pip install fastdist[fitlog]``). Values are
    logged as named scalars, which also works with fitlog 0.9.15 on numpy >= 1.24; the names
    are ``log.jsonl``'s (``loss``, ``lr``, ``dev/<key>``...). On a full disk fitlog's own
    logging fails silently: no warning.

    Args:
        log_dir: fitlog's log directory; default ``<save_path>/fitlog``, else ``logs``.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None) -> None:
        self.log_dir = check_path("FitlogLogger(log_dir)", log_dir)
        self.fitlog: Any = None

    def destination(self, run: RunContext) -> str:
        return os.path.abspath(self.log_dir or run.under_save_path("fitlog", "logs"))

    def open(self, run: RunContext) -> None:
        import fitlog  # optional dependency, imported only when used

        log_dir = self.destination(run)
        os.makedirs(log_dir, exist_ok=True)
        fitlog.set_log_dir(log_dir, new_log=True)
        self.fitlog = fitlog

    def write(self, record: Mapping[str, Any]) -> None:
        super().write(record)
        if record["kind"] == "eval" and record["is_better"]:
            for name, value in scalars(record).items():
                self.fitlog.add_best_metric(value, name=name)

    def log_options(self, options: dict[str, Scalar]) -> None:
        for name, value in options.items():
            if not isinstance(value, bool):
                self.fitlog.add_hyper(value, name=name)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            if name == "loss":
                self.fitlog.add_loss(value, name=name, step=step)
            else:
                self.fitlog.add_metric(value, name=name, step=step)

    def log_test(self, result: dict[str, float]) -> None:
        """Record a test-set result (``test/<key>``) after training (a no-op where the
        backend was not opened: on ranks other than 0)."""
        if self.fitlog is not None:
            for key, value in result.items():
                self.fitlog.add_best_metric(value, name=f"test/{key}")

    def close(self, failed: bool) -> None:
        if self.fitlog is not None:
            self.fitlog.finish(status=1 if failed else 0)
