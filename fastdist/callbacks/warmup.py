"""Learning-rate warmup and decay, set once per optimizer update."""

from __future__ import annotations

import math

from fastdist.callbacks.callback import Callback


class WarmupCallback(Callback):
    """Scale every param group's learning rate by a schedule of training progress.

    Put it in ``callbacks_all``: every rank's optimizer must see the same rate.

    Args:
        warmup: warmup length, as a fraction of all updates (``< 1``) or a number of updates.
        schedule: ``"constant"`` (warmup, then the base rate), ``"linear"`` (warmup, then
            linear decay to 0) or ``"cosine"`` (warmup, then cosine decay to 0).

    Example:
        >>> warmup = WarmupCallback(warmup=0.1, schedule="linear")
    """

    changes_training = True

    def __init__(self, warmup: float = 0.1, schedule: str = "constant") -> None:
        if schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"schedule must be 'constant', 'linear' or 'cosine', got {schedule!r}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.warmup = warmup
        self.schedule = schedule
        self.base_lrs: list[float] = []

    def factor(self, step: int, total: int) -> float:
        """Multiplier of the base rate for update number ``step`` (from 1) of ``total``."""
        warmup_steps = self.warmup * total if self.warmup < 1 else self.warmup
        if step <= warmup_steps:
            return step / warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(total - warmup_steps, 1)
        if self.schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    def on_train_begin(self) -> None:
        if self.trainer.state.total_steps is None and (
            self.schedule != "constant" or 0 < self.warmup < 1
        ):
            raise ValueError(
                f"WarmupCallback(warmup={self.warmup}, schedule={self.schedule!r}) needs the "
                "number of updates, which a streaming train_data does not know: give warmup as "
                "a number of updates (e.g. warmup=100) with schedule='constant'"
            )
        if not self.base_lrs:  # a resumed run restored them: the optimizer holds warmed rates
            self.base_lrs = [group["lr"] for group in self.trainer.optimizer.param_groups]
        self._set_lr()

    def on_step_end(self) -> None:
        self._set_lr()

    def state_dict(self) -> dict[str, list[float]]:
        return {"base_lrs": self.base_lrs}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.base_lrs = list(state["base_lrs"])

    def _set_lr(self) -> None:
        """Set the rate the next update (number ``global_step + 1``) will use."""
        state = self.trainer.state
        total = state.total_steps or 0  # None (a stream): not used, see on_train_begin
        factor = self.factor(state.global_step + 1, total)
        for group, base in zip(self.trainer.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor
