"""``FitlogCallback``: the earlier spelling of ``DistTrainer(loggers=[FitlogLogger(...)])``."""

from __future__ import annotations

from fastdist.callbacks.run_log import RunLogCallback
from fastdist.loggers import FitlogLogger


class FitlogCallback(RunLogCallback):
    """Log the run to fitlog (see :class:`~fastdist.loggers.FitlogLogger`);
    ``DistTrainer(loggers=[FitlogLogger(log_dir)])`` is the newer spelling.

    Args:
        log_dir: fitlog's log directory (created if missing).
    """

    def __init__(self, log_dir: str = "logs") -> None:
        self.logger = FitlogLogger(log_dir)
        super().__init__([self.logger])

    def log_test(self, result: dict[str, float]) -> None:
        """Record a test-set result, e.g. ``trainer.evaluate(test_data)`` after training.

        Call it on every rank (evaluate on every rank: evaluation is a collective); only
        rank 0, where the callback ran, writes.
        """
        self.logger.log_test(result)  # writes only where fitlog was opened: rank 0
