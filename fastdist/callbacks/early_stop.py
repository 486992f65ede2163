"""Stop training when the monitored metric has not improved for a while."""

from __future__ import annotations

from fastdist.callbacks.callback import Callback
from fastdist.logging import logger


class EarlyStopCallback(Callback):
    """Request a stop after ``patience`` evaluations without a new best ``metric_key`` value.

    The request is agreed across ranks before anyone leaves the loop, so it is safe in
    ``callbacks_all`` (every rank sees the same evaluation) and in ``callbacks_master``.

    Example:
        >>> early_stop = EarlyStopCallback(patience=3)
    """

    def __init__(self, patience: int = 3) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = patience
        self.wait = 0

    def state_dict(self) -> dict[str, int]:
        return {"wait": self.wait}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.wait = state["wait"]

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        self.wait = 0 if is_better else self.wait + 1
        if self.wait >= self.patience:
            logger.info("early stop: %s did not improve for %d evaluations", metric_key, self.wait)
            self.trainer.request_stop()
