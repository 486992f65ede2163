"""Record a run with fitlog (https://github.com/fastnlp/fitlog), from rank 0."""

from __future__ import annotations

import os
from typing import Any

from fastdist.callbacks.callback import Callback


class FitlogCallback(Callback):
    """Log hyper-parameters, training loss, evaluation results and the best result to fitlog.

    Put it in ``callbacks_master``. fitlog is imported only when training starts
    (``pip install fastdist[fitlog]``). Values are logged as named scalars, which also works
    with fitlog 0.9.15 on numpy >= 1.24.

    Args:
        log_dir: fitlog's log directory (created if missing).

    The training loss is logged every ``print_every`` updates, when the trainer reduces it;
    the hyper-parameters are the trainer's scalar options plus the world size and the rate.
    :meth:`log_test` records a test result after training.

    Example:
        >>> DistTrainer(..., callbacks_master=[FitlogCallback(log_dir="logs")])
    """

    def __init__(self, log_dir: str = "logs") -> None:
        self.log_dir = log_dir
        self.fitlog: Any = None

    def on_train_begin(self) -> None:
        import fitlog  # optional dependency, imported only when used

        self.fitlog = fitlog
        os.makedirs(self.log_dir, exist_ok=True)
        fitlog.set_log_dir(self.log_dir, new_log=True)
        trainer = self.trainer
        hypers = {"world_size": trainer.world_size, "lr": trainer.optimizer.param_groups[0]["lr"]}
        hypers.update(
            (name, value)
            for name, value in trainer.options.as_dict().items()
            if isinstance(value, (int, float, str)) and not isinstance(value, bool)
        )
        for name, value in hypers.items():
            fitlog.add_hyper(value, name=name)

    def on_step_end(self) -> None:
        state = self.trainer.state
        if state.global_step % self.trainer.options.print_every == 0 and state.loss is not None:
            self.fitlog.add_loss(state.loss, name="loss", step=state.global_step, epoch=state.epoch)

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        state = self.trainer.state
        for key, value in eval_result.items():
            step, epoch = state.global_step, state.epoch
            self.fitlog.add_metric(value, name=f"dev_{key}", step=step, epoch=epoch)
        if is_better:
            for key, value in eval_result.items():
                self.fitlog.add_best_metric(value, name=f"dev_{key}")

    def log_test(self, result: dict[str, float]) -> None:
        """Record a test-set result, e.g. ``trainer.evaluate(test_data)`` after training.

        Call it on every rank (evaluate on every rank, as evaluation is a collective); only
        rank 0, where the callback ran, writes.
        """
        if self.fitlog is not None and self.trainer.is_master:
            for key, value in result.items():
                self.fitlog.add_best_metric(value, name=f"test_{key}")

    def on_train_end(self) -> None:
        self.fitlog.finish()

    def on_exception(self, exception: BaseException) -> None:
        if self.fitlog is not None:
            self.fitlog.finish(status=1)
