"""``RunLogCallback``: runs a :class:`~fastdist.loggers.RunLog` from ``callbacks_master``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastdist.callbacks.callback import Callback
from fastdist.loggers import Logger, RunLog


class RunLogCallback(Callback):
    """Write a run's record to logging backends, on rank 0 only.

    ``DistTrainer(loggers=[...])`` adds one to ``callbacks_master`` (state key ``"loggers"``),
    so the backends run with that list's guarantees: rank 0 only, and no collective (one
    raises at once in a distributed run). Its checkpoint state is the backends' (e.g. an
    MLflow run id), so a resumed run continues the same run.

    Args:
        backends: the :class:`~fastdist.loggers.Logger` objects to write to.
        state_key: its name in checkpoints (``None``: the class's, see
            :attr:`Callback.state_key`).
    """

    def __init__(self, backends: Sequence[Logger], state_key: str | None = None) -> None:
        self.log = RunLog(backends)
        self._state_key = state_key

    @property
    def state_key(self) -> str | None:
        return self._state_key

    def on_train_begin(self) -> None:
        if self.trainer.rank == 0:  # in callbacks_all, the other ranks would write duplicates
            self.log.begin(self.trainer)

    def on_step_end(self) -> None:
        self.log.step_end()

    def on_epoch_end(self) -> None:
        self.log.write_loss()  # e.g. a stream's last update's, agreed at the epoch's end

    def on_valid_begin(self) -> None:
        self.log.valid_begin()

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        self.log.valid_end(eval_result, is_better)

    def on_train_end(self) -> None:
        self.log.end()

    def on_exception(self, exception: BaseException) -> None:
        self.log.fail(exception)

    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "trainer", None)  # rank 0's is saved; the others have none
        return self.log.state_dict() if trainer is None or trainer.rank == 0 else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.log.load_state_dict(state)
