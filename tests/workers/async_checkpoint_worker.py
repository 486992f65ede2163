"""Worker for tests/test_async_checkpoint.py: checkpoints written in the background
(``checkpoint_async=True``), slowed, killed or failing on a full disk on purpose.

Usage (under torchrun, with or without restarts)::

    async_checkpoint_worker.py CASES_JSON OUT_DIR

``CASES_JSON`` lists ``{"name", "config", "async"}`` (``config``: one of resume_worker.py's,
checkpoints every 2 updates into ``OUT_DIR/<name>/checkpoints``, or ``"save_path"``'s), with
at most one fault on rank 0's write (the ``torch.save`` part, in the writer thread) of update
``"at"``:

* ``"slow": SECONDS``: it starts that much later; training goes on meanwhile.
* ``"kill": true``: it writes half the file, then SIGKILLs its process; only in the attempt
  (``TORCHELASTIC_RESTART_COUNT``) equal to the case's index in the list, so that the restarted
  job resumes it and runs the next case.
* ``"fill": "before"|"after"``: the filesystem of ``save_path`` is filled (a file
  ``<save_path>.filler``) before it writes, or after, leaving one page for the manifest.

``"sigterm": S`` sends SIGTERM to every rank after update S, in the case's attempt only. A
restarted job skips the cases an earlier attempt finished.

Rank R writes ``OUT_DIR/<name>-<attempt>.rank<R>.json``: the step it started at, its final
parameters (its shards) and, on rank 0, the updates done at the slowed write's start and end;
or ``{"error", "step"}`` when ``train()`` raised. ``.ids.jsonl`` as resume_worker.py's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from workers.ending import exit_from
from workers.resume_worker import Faults, IdLog, build_trainer, flat_params, write_json

import fastdist.checkpoint.checkpointer as checkpointer_module
import fastdist.checkpoint.files as files_module
from fastdist import Callback, get_rank
from fastdist.checkpoint.files import atomic_file, atomic_save
from fastdist.state import TrainerState

EVERY = 2  # checkpoint_every
PAGE = 4096


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def fill(path: str, spare: int) -> None:
    """Fill the filesystem of ``path`` with the file ``path``, but for ``spare`` bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        for block in (b"\0" * (1 << 16), b"\0" * PAGE):
            with contextlib.suppress(OSError):  # ENOSPC: then the smaller blocks
                while True:
                    os.write(fd, block)
    finally:
        os.close(fd)
    os.truncate(path, os.path.getsize(path) - spare)


class Fault:
    """Replaces fastdist's ``atomic_save`` (on rank 0, which alone calls it) with one that
    injects ``case``'s fault into the write of update ``case["at"]``."""

    def __init__(self, case: dict[str, Any], index: int, state: TrainerState) -> None:
        self.case, self.state = case, state
        self.kill = bool(case.get("kill")) and attempt() == index
        self.steps: list[int] = []  # updates done when the slowed write starts and ends

    def save(self, obj: Any, path: str) -> int:
        case = self.case
        if "at" not in case or f"step-{case['at']:08d}" not in path:
            return atomic_save(obj, path)
        if "slow" in case:
            self.steps.append(self.state.global_step)
            time.sleep(case["slow"])
            self.steps.append(self.state.global_step)
        if self.kill:  # half the file on disk, then the process gone
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            with atomic_file(path) as f:
                f.write(buffer.getvalue()[: buffer.tell() // 2])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        filler = f"{case['save_path']}.filler"
        if case.get("fill") == "before":
            fill(filler, 0)
        checksum = atomic_save(obj, path)
        if case.get("fill") == "after":
            fill(filler, PAGE)
        return checksum


class NewestAtEnd(Callback):
    """The newest checkpoint of the manifest as ``on_train_end`` sees it (on every rank)."""

    def __init__(self, checkpoints: Path) -> None:
        self.manifest, self.step = checkpoints / "manifest.json", None

    def on_train_end(self) -> None:
        if self.manifest.exists():
            self.step = json.loads(self.manifest.read_text())[-1]["step"]


def run_case(case: dict[str, Any], index: int, out: Path) -> dict[str, Any]:
    save_path = Path(case.get("save_path", out / case["name"]))
    save_path.mkdir(parents=True, exist_ok=True)
    prefix = f"{case['name']}-{attempt()}.rank{get_rank()}"
    ids = IdLog(out / f"{prefix}.ids.jsonl")
    sigterm = Faults(sigterm_at=case.get("sigterm") if attempt() == index else None)
    newest = NewestAtEnd(save_path / "checkpoints")
    callbacks = [ids, sigterm, newest]  # the same in every case: a checkpoint holds their states
    trainer = build_trainer(
        case["config"], save_path, EVERY, callbacks, checkpoint_async=case["async"]
    )
    fault = Fault({**case, "save_path": str(save_path)}, index, trainer.state)
    checkpointer_module.atomic_save = files_module.atomic_save = fault.save  # type: ignore[assignment]
    try:
        result = trainer.train()
    except Exception as exc:  # the outcome under test: the same on every rank
        return {"error": f"{type(exc).__name__}: {exc}", "step": trainer.state.global_step}
    finally:
        ids.file.close()
        checkpointer_module.atomic_save = files_module.atomic_save = atomic_save
        with contextlib.suppress(FileNotFoundError):  # the disk freed for the next case
            os.remove(f"{save_path}.filler")
    return {
        "start_step": ids.start_step,
        "steps": result["steps"],
        "final": flat_params(trainer.model),
        "slowed": fault.steps,
        "newest_at_end": newest.step,
    }


def finished(out: Path, name: str) -> bool:
    """Whether both ranks wrote a result of case ``name`` in an earlier attempt."""
    return any(
        all((out / f"{name}-{earlier}.rank{rank}.json").exists() for rank in (0, 1))
        for earlier in range(attempt())
    )


def main(argv: list[str]) -> int:
    cases, out = json.loads(Path(argv[1]).read_text()), Path(argv[2])
    for index, case in enumerate(cases):
        if finished(out, case["name"]):  # a restarted job goes on with the case it died in
            continue
        result = run_case(case, index, out)
        write_json(out / f"{case['name']}-{attempt()}.rank{get_rank()}.json", result)
    return 0


if __name__ == "__main__":
    exit_from(lambda: main(sys.argv))
