"""Worker for tests/test_bad_input.py: every row of its table in one world, in this order.

Usage (under torchrun)::

    bad_input_worker.py OUT_DIR

1. ``"init"`` rows: ``DistTrainer(...)`` must raise; record the exception and whether a
   process group exists afterwards (none has been formed yet).
2. ``"first_batch"`` rows: ``DistTrainer(...).train()`` must raise on every rank at the same
   micro-batch, before any collective of it, so the world stays usable for the next row.
3. Rank 0 makes every call of ``GUARDED_CALLS`` inside the callbacks_master guard; then a
   barrier and an all-reduce on both ranks show the gates open again.
   ``OUT_DIR/rank<R>.json`` is written now.
4. The hook row: rank 0's callbacks_master hook calls ``barrier``. Each rank adds its
   exception and the time to its JSON and re-raises, so the launch fails. Both ranks ignore
   SIGTERM in this step: torchrun sends it to rank 1 once rank 0 has exited, and it must not
   kill rank 1 before its JSON is written (rank 1 exits by itself right after).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from test_bad_input import GUARDED_CALLS, HOOK_ROW, ROWS, Row
from torch import nn
from workers.ending import exit_now
from workers.trainer_worker import ToyData, ToyNet, write_json

from fastdist import CrossEntropyLoss, DistTrainer
from fastdist.distributed import get_rank
from fastdist.distributed.guard import no_collectives


def build(row: Row) -> DistTrainer:
    """A quiet CPU trainer on ``ToyData(32)`` and ``ToyNet`` with SGD, with ``row``'s keywords."""
    given = row.given() if callable(row.given) else dict(row.given)
    kwargs: dict[str, Any] = {
        "train_data": ToyData(32),
        "model": ToyNet(),
        "loss": CrossEntropyLoss(),
        "batch_size_per_gpu": 8,
        "print_every": 10_000,
        "use_tqdm": False,
        "device": "cpu",
        **given,
    }
    model = kwargs["model"]
    trainable = isinstance(model, nn.Module) and any(p.requires_grad for p in model.parameters())
    if "optimizer" not in kwargs and trainable:
        kwargs["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    return DistTrainer(**kwargs)


def error_of(exc: BaseException | None, **more: Any) -> dict[str, Any]:
    if exc is None:
        return {"type": None, "message": "no exception", **more}
    return {"type": type(exc).__name__, "message": str(exc), **more}


def run_row(row: Row) -> dict[str, Any]:
    trainer = None
    try:  # a strategy object checks its options when it is built, in the builder
        trainer = build(row)
        if row.when != "init":
            trainer.train()
    except Exception as exc:
        error = error_of(exc)
    else:
        error = error_of(None)
    error["group_after"] = dist.is_initialized()
    if trainer is not None:
        error.update(global_step=trainer.state.global_step, batch_idx=trainer.state.batch_idx)
    return error


def run_guarded() -> dict[str, Any]:
    """Rank 0: each call inside the guard, as a callbacks_master hook runs."""
    refused = {}
    for name, (call, _) in GUARDED_CALLS.items():
        try:
            with no_collectives("callbacks_master hook Probe.on_step_end"):
                call()
        except Exception as exc:
            refused[name] = error_of(exc)
        else:
            refused[name] = error_of(None)
    return refused


def main(out: Path) -> None:
    order = sorted(ROWS, key=lambda name: ROWS[name].when != "init")  # stable: init first
    results: dict[str, Any] = {"rows": {name: run_row(ROWS[name]) for name in order}}
    if get_rank() == 0:
        results["guarded"] = run_guarded()
    dist.barrier()
    total = torch.ones(1)
    dist.all_reduce(total)
    results["after_guard"] = total.item()
    write_json(out, results)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    trainer = build(HOOK_ROW)
    try:
        trainer.train()
    except Exception as exc:
        results["hook"] = error_of(exc, time=time.time())
        write_json(out, results)
        raise
    results["hook"] = error_of(None, time=time.time())
    write_json(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_now()
