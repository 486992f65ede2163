"""Worker for tests/test_resume.py: ``train(resume=...)`` with checkpoint files made wrong.

Usage (under torchrun)::

    checkpoint_worker.py CASES_JSON OUT_DIR

``CASES_JSON`` lists ``{"name", "config", "save_path", "resume"}`` (``resume``: ``"auto"``,
``false`` or a path); the cases run in order in one process (group), each a trainer of
resume_worker.py's ``config`` that trains with ``train(resume=...)``. Rank R writes
``OUT_DIR/<name>.rank<R>.json``: ``{"error": "<type>: <message>"}`` when ``train()`` raised,
else the step it started at and its final parameters (this rank's shards).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from workers.resume_worker import IdLog, build_trainer, flat_params, write_json

from fastdist import get_rank


def run_case(case: dict[str, Any], out: Path) -> dict[str, Any]:
    ids = IdLog(out / f"{case['name']}.rank{get_rank()}.ids.jsonl")
    trainer = build_trainer(case["config"], Path(case["save_path"]), callbacks=[ids])
    try:
        trainer.train(resume=case["resume"])
    except Exception as exc:  # the outcome under test: the same on every rank
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        ids.file.close()
    return {"start_step": ids.start_step, "final": flat_params(trainer.model)}


def main(argv: list[str]) -> int:
    cases, out = json.loads(Path(argv[1]).read_text()), Path(argv[2])
    for case in cases:
        write_json(out / f"{case['name']}.rank{get_rank()}.json", run_case(case, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
