"""Worker for the campaign's node-loss and network faults (tests/campaign_faults.py):
resume_worker's "plain" run, resumed with ``resume="auto"``, slowed down so that a fault
lands mid-training.

Usage (under torchrun, one or several nodes)::

    slow_worker.py OUT_DIR [--sleep S] [--sleep-alone A] [--epochs E] [--timeout T]

Each attempt of each rank writes ``OUT_DIR/p<pid>.rank<R>.ids.jsonl``: a first line
``{"start", "start_step", "world"}`` (wall time, the step it resumed at, the world size), then
resume_worker's IdLog line of every update it completed, each flushed at once; the update
sleeps ``S`` s after it completed (``A`` s in a world of one process).
``OUT_DIR/done.rank<R>.json`` is written when training ended. Checkpoints go to
``OUT_DIR/run/checkpoints``, one per update.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from workers.ending import exit_now
from workers.resume_worker import IdLog, build_trainer, write_json

from fastdist import get_rank, get_world_size


class SlowIdLog(IdLog):
    """IdLog with a first line saying where and how wide this attempt started; sleeps
    ``sleep`` s after every update."""

    def __init__(self, path: Path, sleep: float) -> None:
        super().__init__(path)
        self.sleep = sleep

    def on_train_begin(self) -> None:
        super().on_train_begin()
        start = {"start": time.time(), "start_step": self.start_step, "world": get_world_size()}
        self.file.write(json.dumps(start) + "\n")
        self.file.flush()

    def on_step_end(self) -> None:
        super().on_step_end()
        time.sleep(self.sleep)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sleep", type=float, default=0.3)
    parser.add_argument("--sleep-alone", type=float, default=None, help="default: --sleep")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv[1:])
    out = Path(args.out)
    alone = args.sleep if args.sleep_alone is None else args.sleep_alone
    sleep = alone if get_world_size() == 1 else args.sleep
    ids = SlowIdLog(out / f"p{os.getpid()}.rank{get_rank()}.ids.jsonl", sleep)
    trainer = build_trainer(
        "plain", out / "run", callbacks=[ids], n_epochs=args.epochs, timeout=args.timeout
    )
    try:
        trainer.train()
    finally:
        ids.file.close()
    write_json(out / f"done.rank{get_rank()}.json", {"steps": trainer.state.global_step})
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
