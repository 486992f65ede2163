"""Worker for tests/test_timing.py: per-rank timings, the slow-rank report and the profiler.

Usage (under torchrun or as a plain process)::

    timing_worker.py OUT_DIR

Case ``slow``: rank 1's ``collate_fn`` sleeps 30 ms per micro-batch; 12 updates with
``print_every=2`` and ``save_path=OUT_DIR/slow`` (so ``OUT_DIR/slow/log.jsonl``), counting the
all-reduces. Case ``profile``: ``ProfilerCallback`` in ``callbacks_all`` writes its traces to
``OUT_DIR/profile``. Each rank writes what it saw to ``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from torch.utils.data import default_collate
from trainer_worker import BATCH, CommCounter, make_trainer, warnings_logged
from workers.ending import exit_now

from fastdist.callbacks import ProfilerCallback
from fastdist.distributed import get_rank, get_world_size

SLEEP_S = 0.03
UPDATES, PRINT_EVERY = 12, 2


def slow_on_rank_1(samples: list[Any]) -> Any:
    """The default collate, 30 ms slower on rank 1: a rank with a slow data pipeline."""
    if get_rank() == 1:
        time.sleep(SLEEP_S)
    return default_collate(samples)


def case_slow(out: Path) -> dict[str, Any]:
    counter = CommCounter()
    trainer = make_trainer(
        UPDATES * BATCH * get_world_size(),
        collate_fn=slow_on_rank_1,
        print_every=PRINT_EVERY,
        save_path=str(out / "slow"),
        callbacks_all=[counter],
    )
    with counter.counting_all_reduce(), warnings_logged() as lines:
        result = trainer.train()
    return {
        "warnings": lines,
        "steps": result["steps"],
        "other_all_reduces": counter.other_all_reduces,
        "rank_times": trainer.state.rank_times,
    }


def case_fsdp(out: Path) -> dict[str, Any]:
    """Under FSDP (every forward waits for the other rank): rank 1's slow collate, then a
    healthy run; the slow-rank WARNINGs rank 0 logs in each."""
    results = {}
    for name, collate in (("slow", slow_on_rank_1), ("healthy", None)):
        trainer = make_trainer(
            UPDATES * BATCH * get_world_size(),
            collate_fn=collate,
            print_every=PRINT_EVERY,
            strategy="fsdp",
        )
        with warnings_logged() as lines:
            trainer.train()
        results[name] = lines
    return results


def case_healthy() -> list[str]:
    """A DDP run with nothing slow: the slow-rank WARNINGs rank 0 logs (none expected)."""
    trainer = make_trainer(4 * UPDATES * BATCH * get_world_size(), print_every=PRINT_EVERY)
    with warnings_logged() as lines:
        trainer.train()
    return lines


def case_profile(out: Path) -> dict[str, Any]:
    profiler = ProfilerCallback(wait=1, warmup=1, active=2, dir=out / "profile")
    trainer = make_trainer(6 * BATCH * get_world_size(), callbacks_all=[profiler])
    trainer.train()
    return {"trace": profiler.trace_path, "open": profiler.profiler is not None}


def main() -> None:
    out = Path(sys.argv[1])
    results = {"slow": case_slow(out), "profile": case_profile(out)}
    if get_world_size() > 1:
        results.update(fsdp=case_fsdp(out), healthy=case_healthy())
    (out / f"rank{get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    exit_now()
