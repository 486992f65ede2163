"""What ``python -m fastdist check-resume`` asks of a trainer, through one environment variable.

``FASTDIST_CHECK_RESUME`` is the tool's (:mod:`fastdist.cli.check_resume`), not a user's: a JSON
object ``{"save_path": DIR, "checkpoint_every": K, "stop_at": S, "kill": bool}``. While it is
set, every ``DistTrainer`` of the script trains into ``DIR`` (its ``save_path``;
``checkpoint_dir`` is ignored) with a checkpoint every ``K`` updates and stops at update ``S``
once that update's checkpoint is written; then each process ends before ``train()`` returns
(the script's code after it does not run): with exit status 0, or with ``kill`` by ``SIGKILL``,
as a killed job would. A script that trains fewer updates ends there too, with exit status 0:
the tool reads the updates it reached from its newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from fastdist.callbacks.callback import Callback

VAR = "FASTDIST_CHECK_RESUME"


def _asked() -> dict[str, Any] | None:
    value = os.environ.get(VAR)
    return None if not value else dict(json.loads(value))


def overridden(given: Mapping[str, Any]) -> Mapping[str, Any]:
    """``DistTrainer``'s arguments with the tool's ``save_path`` and checkpoint period."""
    asked = _asked()
    if asked is None:
        return given
    every = asked["checkpoint_every"]
    return dict(given, save_path=asked["save_path"], checkpoint_dir=None, checkpoint_every=every)


def callbacks() -> list[Callback]:
    """The tool's stop (and kill) at its update, as a callback of every rank; none unless
    the tool runs the script."""
    asked = _asked()
    return [] if asked is None else [_StopAt(asked["stop_at"], asked["kill"])]


class _StopAt(Callback):
    """Stops training at update ``step`` (its checkpoint is due then) and ends the process
    there: exit status 0, or ``SIGKILL`` if ``kill``; where training ended earlier, exit
    status 0 (the tool names the updates reached)."""

    def __init__(self, step: int, kill: bool) -> None:
        self.step, self.kill = step, kill

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == self.step:
            self.trainer.request_stop()  # agreed at that update's checkpoint

    def on_train_end(self) -> None:
        logging.shutdown()  # flush the log
        sys.stdout.flush()
        if self.kill and self.trainer.state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
