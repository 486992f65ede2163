"""Worker for the launcher tests (tests/test_ray.py, tests/test_slurm.py, tests/test_launchers.py):
one training run, however it was launched.

Usage::

    launcher_worker.py OUT_DIR [--save-path P] [--hold-at S] [--ranks-only]
    train_fn({"out": OUT_DIR, "save_root": DIR, "kill_at": S, "drop_env": True})  # Ray Train

It trains tests/workers/resume_worker.py's ``plain`` config (a float64 MLP with dropout, 2 epochs
of 9 updates on 2 ranks, here a checkpoint every 4 updates). Every start of a rank counts as an
attempt (``OUT_DIR/starts.rank<R>`` gets a line), and each attempt writes

* ``<A>.rank<R>.ids.jsonl``: the sample ids of every update (resume_worker's ``IdLog``);
* ``<A>.rank<R>.json``: the ranks fastdist sees (and Ray's context, under Ray), whether the
  ``callbacks_master`` probe ran here, and the result and whole final parameters, or the exit
  code of a pre-emption.

``--hold-at S`` (first attempt only) makes every rank write ``OUT_DIR/held`` after update S and
wait there until ``OUT_DIR/go`` exists (a test sends a signal meanwhile); ``kill_at`` makes
rank 1 die (``os._exit(1)``) after update S of the first attempt (under Ray once Ray has
registered the checkpoints reported so far). Under Ray, rank 0 picks a new
empty ``save_path`` under ``save_root`` in every attempt, as on a fresh node; ``drop_env``
removes the rank variables Ray Train v2 exports, so that fastdist must read Ray's context.
``--ranks-only`` forms the group and writes the ranks, without training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workers.ending import exit_from
from workers.resume_worker import IdLog, build_trainer, full_params

import fastdist
from fastdist import Callback
from fastdist.distributed import get_node_rank
from fastdist.distributed.env import get_local_world_size
from fastdist.distributed.ray_train import ray_train_context

KILL_RANK = 1


class MasterProbe(Callback):
    """Notes that ``callbacks_master`` ran in this process."""

    ran = False

    def on_train_begin(self) -> None:
        self.ran = True


class Faults(Callback):
    """Holds every rank after update ``hold_at`` until ``go`` exists; kills rank 1 after
    update ``kill_at``."""

    def __init__(self, out: Path, hold_at: int | None, kill_at: int | None) -> None:
        self.out, self.hold_at, self.kill_at = out, hold_at, kill_at

    def on_step_end(self) -> None:
        step = self.trainer.state.global_step
        if step == self.kill_at and fastdist.get_rank() == KILL_RANK:
            # Under Ray, milliseconds after the report of the checkpoint before: Ray has not
            # registered it yet (get_checkpoint() then misses it), its files are stored.
            os._exit(1)
        if step == self.hold_at:
            (self.out / "held").touch()
            deadline = time.monotonic() + 60
            while not (self.out / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def ranks() -> dict[str, Any]:
    """The ranks fastdist sees, and Ray Train's (if this is a Ray Train worker)."""
    seen = {
        "rank": fastdist.get_rank(),
        "world_size": fastdist.get_world_size(),
        "local_rank": fastdist.get_local_rank(),
        "local_world_size": get_local_world_size(),
        "node_rank": get_node_rank(),
    }
    context = ray_train_context()
    if context is not None:
        seen["ray"] = {
            "rank": context.get_world_rank(),
            "world_size": context.get_world_size(),
            "local_rank": context.get_local_rank(),
            "local_world_size": context.get_local_world_size(),
            "node_rank": context.get_node_rank(),
        }
    return seen


def next_attempt(out: Path) -> int:
    """This rank's attempt, counted from 0 (a line per start in ``starts.rank<R>``)."""
    starts = out / f"starts.rank{fastdist.get_rank()}"
    before = len(starts.read_text().splitlines()) if starts.exists() else 0
    with open(starts, "a") as f:
        f.write(f"{os.getpid()}\n")
    return before


def train(
    out: Path, save_path: Path, hold_at: int | None = None, kill_at: int | None = None
) -> dict[str, Any]:
    """Train once; write and return this rank's record."""
    rank = fastdist.get_rank()
    attempt = next_attempt(out)
    first = attempt == 0
    probe = MasterProbe()
    faults = Faults(out, hold_at if first else None, kill_at if first else None)
    trainer = build_trainer(
        "plain",
        save_path,
        checkpoint_every=4,
        callbacks=[IdLog(out / f"{attempt}.rank{rank}.ids.jsonl"), faults],
        callbacks_master=[probe],
    )
    record: dict[str, Any] = {"attempt": attempt, "ranks": ranks(), "save_path": str(save_path)}
    path = out / f"{attempt}.rank{rank}.json"
    path.write_text(json.dumps(record))  # a rank Ray kills while it reports a failure has this
    try:
        record["result"] = trainer.train()
        record["params"] = full_params(trainer.model)
    except SystemExit as exc:  # pre-empted: a checkpoint was written
        record["exit_code"] = exc.code
        raise
    finally:
        record["master_probe_ran"] = probe.ran
        path.write_text(json.dumps(record))
    return record


def train_fn(config: dict[str, Any]) -> None:
    """The Ray Train training function: what a user's script would run, plus the probes."""
    if config.get("drop_env"):
        for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
            os.environ.pop(name, None)
    root = Path(config["save_root"])
    save_path = fastdist.broadcast_object(
        tempfile.mkdtemp(dir=root) if fastdist.is_master() else None
    )
    train(Path(config["out"]), Path(save_path), kill_at=config.get("kill_at"))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--save-path", type=Path)
    parser.add_argument("--hold-at", type=int)
    parser.add_argument("--ranks-only", action="store_true")
    args = parser.parse_args(argv)
    if args.ranks_only:
        fastdist.init_distributed()
        everyone = fastdist.all_gather_object(ranks())
        (args.out / f"rank{fastdist.get_rank()}.json").write_text(json.dumps(everyone))
        return
    train(args.out, args.save_path or args.out / "save", hold_at=args.hold_at)


if __name__ == "__main__":
    exit_from(lambda: main(sys.argv[1:]))
