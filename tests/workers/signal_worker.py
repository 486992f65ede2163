"""Worker for the torchrun-under-srun recipe test (tests/test_slurm.py): slow updates, the next
log step, evaluation and checkpoint minutes away.

Usage (under torchrun)::

    signal_worker.py OUT_DIR

Every update takes :data:`PACE` seconds (a callback sleeps); after update :data:`START` rank 0
writes torchrun's process id (its parent's) to ``OUT_DIR/started``, for the test to signal it.
Checkpoints go to ``OUT_DIR/save``; each rank writes ``OUT_DIR/rank<R>.json``: the exit code of
its pre-emption (``None`` if training ended) and the step it stopped at.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from workers.ending import exit_from
from workers.trainer_worker import make_trainer

from fastdist import Callback, get_rank

PACE, START = 0.2, 3
N_SAMPLES = 8000  # 500 updates per rank and epoch on 2 ranks: 100 s to the epoch's end


class Pace(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_step_end(self) -> None:
        time.sleep(PACE)
        if self.trainer.state.global_step == START and get_rank() == 0:
            (self.out / "started.tmp").write_text(str(os.getppid()))
            (self.out / "started.tmp").rename(self.out / "started")


def main(out: Path) -> None:
    trainer = make_trainer(N_SAMPLES, save_path=str(out / "save"), callbacks_all=[Pace(out)])
    code = None
    try:
        trainer.train()
    except SystemExit as exc:
        code = exc.code
        raise
    finally:
        step = trainer.state.global_step
        (out / f"rank{get_rank()}.json").write_text(json.dumps({"exit_code": code, "step": step}))


if __name__ == "__main__":
    exit_from(lambda: main(Path(sys.argv[1])))
