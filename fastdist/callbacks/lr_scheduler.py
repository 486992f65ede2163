"""Step a torch learning-rate scheduler once per optimizer update."""

from __future__ import annotations

from typing import Any

from fastdist.callbacks.callback import Callback


class LRSchedulerCallback(Callback):
    """Call ``scheduler.step()`` after every optimizer update (or every epoch).

    Put it in ``callbacks_all``.

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` object built on the trainer's optimizer.
        interval: ``"step"`` (after every update) or ``"epoch"``.

    Example:
        >>> sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
        >>> scheduler = LRSchedulerCallback(sched)
    """

    def __init__(self, scheduler: Any, interval: str = "step") -> None:
        if interval not in ("step", "epoch"):
            raise ValueError(f"interval must be 'step' or 'epoch', got {interval!r}")
        self.scheduler = scheduler
        self.interval = interval

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def on_step_end(self) -> None:
        if self.interval == "step":
            self.scheduler.step()

    def on_epoch_end(self) -> None:
        if self.interval == "epoch":
            self.scheduler.step()
