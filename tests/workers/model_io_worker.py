"""Worker for tests/test_model_io.py: trainers one after another in one process, and the
collective methods called on rank 0 only.

Usage (under torchrun)::

    model_io_worker.py trainers OUT_DIR  # 4 ranks: DDP, FSDP, compiled, 2-D, FSDP, DDP
    model_io_worker.py rank0 OUT_DIR     # 2 ranks: save_model and predict on rank 0 alone

Writes ``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.ending import exit_now
from workers.tp_worker import PLAN, flat, trainer
from workers.trainer_worker import ToyData, write_json

import fastdist
from fastdist import CrossEntropyLoss, DistTrainer, get_rank
from fastdist.strategies import FSDP

#: (name, strategy, batch, options) of the trainers run one after another, each with a
#: timeout (a process group of its own, torn down with it); one global batch (2-D: tp peers
#: share batches).
SEQUENCE: list[tuple[str, Any, int, dict[str, Any]]] = [
    ("ddp", "ddp", 4, {}),
    ("fsdp", "fsdp", 4, {}),
    ("compiled", "ddp", 4, {"compile": True}),
    ("2d", FSDP(tp=2, tp_plan=PLAN), 8, {}),
    ("fsdp_again", "fsdp", 4, {}),
    ("ddp_again", "ddp", 4, {}),
]


def trainers() -> dict[str, Any]:
    """Each trainer's updates, final parameters (rank 0) and dev loss, or its error."""
    results: dict[str, Any] = {}
    for name, strategy, batch, options in SEQUENCE:
        try:
            run = trainer(strategy, batch, **options)
            steps = run.train()["steps"]
            params = flat(run.strategy.full_state_dict())
            results[name] = {"steps": steps, "params": params, "eval": run.evaluate()}
        except Exception as exc:  # the later trainers still show whether they run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        run = None  # type: ignore[assignment]
        gc.collect()  # the trainer and its process group go now, as in a long loop
    return results


def reused_model() -> str | None:
    """The error of a second trainer given the model an FSDP trainer sharded (``None``: none)."""
    first = trainer("fsdp", 4)
    first.train()
    try:
        DistTrainer(ToyData(8), first.model, loss=CrossEntropyLoss(), use_tqdm=False, device="cpu")
    except ValueError as exc:
        return str(exc)
    return None


def timed(call: Callable[[], Any]) -> dict[str, Any]:
    """The error ``call`` raised (``None``: none) and the seconds it took."""
    start = time.monotonic()
    try:
        call()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": round(time.monotonic() - start, 2)}


def rank_zero_only(out: Path) -> dict[str, Any]:
    """Rank 0 calls save_model and ``fastdist.predict`` while rank 1 sleeps (each wait runs
    out: the trainer's timeout, 5 s, which the group holds), then save_model,
    ``trainer.predict``, ``trainer.evaluate``, ``fastdist.predict`` and ``fastdist.barrier``
    once rank 1's script has ended."""
    run = trainer("fsdp", 4, timeout=5)
    run.train()
    result: dict[str, Any] = {}
    if get_rank() == 0:
        result["busy"] = timed(lambda: run.save_model(out / "busy.pt"))
        result["busy_predict"] = timed(lambda: fastdist.predict(run.model, ToyData(8)))
        result["ended"] = timed(lambda: run.save_model(out / "ended.pt"))
        result["predict"] = timed(lambda: run.predict(ToyData(8)))
        result["evaluate"] = timed(lambda: run.evaluate())
        result["fastdist.predict"] = timed(lambda: fastdist.predict(run.model, ToyData(8)))
        result["barrier"] = timed(fastdist.barrier)  # not passed by rank 1's exit barrier
    else:
        time.sleep(12)  # then the script ends: the exit handler tells rank 0
    return result


def main(mode: str, out: Path) -> None:
    if mode == "trainers":
        write_json(out, {"sequence": trainers(), "reused": reused_model()})
    else:
        write_json(out, rank_zero_only(out))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    exit_now()
