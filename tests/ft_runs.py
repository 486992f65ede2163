"""Runs of ``python -m fastdist ft`` and the records their test workers write
(``tests/workers/ft_rules_worker.py``, ``ft_audit_worker.py``): each attempt's JSON lines as it
trains and its JSON end record."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from launch import Launch, run_together


def run_ft(
    worker: Path, out: Path, ft_args: list[str], worker_args: list[str], timeout: float = 240
) -> Any:
    """``python -m fastdist ft --groups 2 FT_ARGS WORKER -- OUT WORKER_ARGS``: the launch's
    result and every attempt's :func:`records`."""
    out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "fastdist", "ft", "--groups", "2", *ft_args]
    (result,) = run_together([Launch([*cli, str(worker), "--", str(out), *worker_args])], timeout)
    return result, records(out)


def records(out: Path) -> dict[str, dict[str, Any]]:
    """Every attempt's records under its file name (``group<G>...attempt<A>``): its updates,
    micro-batches and micro-batch losses as they happened, the step it began at, and its end
    record where it ended."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(out.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        found[path.stem] = {
            "updates": [u for u in lines if "groups" in u],
            "batches": [u for u in lines if "batch" in u],
            "micro": [u for u in lines if "micro_loss" in u],
            "begin": next((u["begin"] for u in lines if "begin" in u), None),
        }
    for path in out.glob("*.json"):
        found.setdefault(path.stem, {}).update(json.loads(path.read_text()))
    return found
