"""Worker for tests/test_resume.py and tests/test_disk_full.py: ``train(resume=...)`` with
checkpoint files made wrong, or a disk that fills up.

Usage (under torchrun)::

    checkpoint_worker.py CASES_JSON OUT_DIR

``CASES_JSON`` lists ``{"name", "config", "save_path", "resume"}`` (``resume``: ``"auto"``,
``false`` or a path; an optional ``"fill": [STEP, FILE]`` makes rank 0 fill the checkpoints'
filesystem with ``FILE`` after update STEP, leaving half a checkpoint's space, or none with
``"fill": [STEP, FILE, 0]``; an optional ``"checkpoint_dir"`` moves the checkpoints there;
``"evaluate": true`` evaluates every epoch, keeping the best model in a file; rank 0 deletes
the file ``"unfill"`` names first, if any: space freed; ``"hidden"``, ``"adamw"`` and ``"frozen"``:
another model and optimizer, as ``build_trainer`` takes them); the cases
run in order in one process (group), each a trainer of resume_worker.py's ``config`` that
trains with ``train(resume=...)``. Rank R writes
``OUT_DIR/<name>.rank<R>.json``: ``{"error": "<type>: <message>"}`` when ``train()`` raised,
else the step it started at, whether that was a rollback, the updates it trained to and its
final parameters (this rank's shards). After a case
that raised, rank 0 writes ``OUT_DIR/<name>.left.json``: the names in the checkpoint directory
and the steps its manifest lists.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from workers.ending import exit_now
from workers.resume_worker import IdLog, build_trainer, flat_params, write_json
from workers.trainer_worker import ToyData

from fastdist import AccuracyMetric, Callback, get_rank


class FillDisk(Callback):
    """After update ``step`` (its checkpoint written, after its ``on_batch_end``: at the next
    ``on_batch_begin``), fill the filesystem of ``filler`` with it, but for ``spare`` bytes
    (default: half the size of that checkpoint, so that the next checkpoint fails
    part-written)."""

    def __init__(self, step: int, filler: str, checkpoints: Path, spare: int | None = None) -> None:
        self.step, self.filler, self.checkpoints, self.spare = step, filler, checkpoints, spare

    def on_batch_begin(self, batch: Any) -> None:
        if self.trainer.state.global_step != self.step or os.path.exists(self.filler):
            return
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            for block in (b"\0" * (1 << 16), b"\0" * (1 << 12)):
                with contextlib.suppress(OSError):  # ENOSPC: then the smaller blocks
                    while True:
                        os.write(fd, block)
        finally:
            os.close(fd)
        spare = self.spare
        if spare is None:
            spare = (self.checkpoints / f"step-{self.step:08d}.pt").stat().st_size // 2
        os.truncate(self.filler, os.path.getsize(self.filler) - spare)


def run_case(case: dict[str, Any], out: Path) -> dict[str, Any]:
    if "unfill" in case and get_rank() == 0:
        os.unlink(case["unfill"])
    ids = IdLog(out / f"{case['name']}.rank{get_rank()}.ids.jsonl")
    save_path = Path(case["save_path"])
    checkpoints = Path(case.get("checkpoint_dir", save_path / "checkpoints"))
    fill = []
    if "fill" in case:
        step, filler, *spare = case["fill"]
        fill = [FillDisk(step, filler, checkpoints, *spare)]
    options: dict[str, Any] = {"checkpoint_dir": str(checkpoints)}
    if case.get("evaluate"):
        options.update(dev_data=ToyData(16, seed=1), metrics=AccuracyMetric(), metric_key="acc")
    options.update({key: case[key] for key in ("hidden", "adamw", "frozen") if key in case})
    trainer = build_trainer(
        case["config"], save_path, callbacks=[ids], callbacks_master=fill, **options
    )
    try:
        result = trainer.train(resume=case["resume"])
    except Exception as exc:  # the outcome under test: the same on every rank
        if get_rank() == 0 and fill and (checkpoints / "manifest.json").exists():
            manifest = json.loads((checkpoints / "manifest.json").read_text())
            left = {
                "names": sorted(os.listdir(checkpoints)),
                "steps": [e["step"] for e in manifest],
            }
            write_json(out / f"{case['name']}.left.json", left)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        ids.file.close()
    return {
        "start_step": ids.start_step,
        "rolled_back": ids.rolled_back,
        "steps": result["steps"],
        "final": flat_params(trainer.model),
    }


def main(argv: list[str]) -> int:
    cases, out = json.loads(Path(argv[1]).read_text()), Path(argv[2])
    for case in cases:
        write_json(out / f"{case['name']}.rank{get_rank()}.json", run_case(case, out))
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
