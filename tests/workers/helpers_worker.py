"""Worker for tests/test_helpers.py: exercise fastdist's distributed helpers in a real world.

Usage (under torchrun or as a plain process)::

    helpers_worker.py CASE[,CASE...] OUT_DIR

Runs the named cases in order and writes ``{"meta": ..., CASE: result, ...}`` as JSON to
``OUT_DIR/rank<R>.json``. The cases ``fail`` and ``hang`` test the launcher itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from workers.ending import exit_now

from fastdist.distributed import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
    is_master,
    rank_zero_first,
    rank_zero_only,
)
from fastdist.logging import logger


def case_logger(out: Path) -> dict[str, Any]:
    """Log at INFO and WARNING before the group exists and again after a barrier."""
    rank = get_rank()
    group_at_first_log = dist.is_initialized()
    logger.info("info-from-rank-%d before-group", rank)
    logger.warning("warn-from-rank-%d before-group", rank)
    barrier()  # creates the process group when there are several processes
    logger.info("info-from-rank-%d after-barrier", rank)
    logger.warning("warn-from-rank-%d after-barrier", rank)
    return {"group_at_first_log": group_at_first_log}


def case_rank_zero_first(out: Path) -> dict[str, Any]:
    """Rank 0 sleeps inside the block, then writes a flag the others must see on entry."""
    result: dict[str, Any] = {}
    for local in (True, False):
        name = "local" if local else "global"
        flag = out / f"ready-{name}"
        barrier()  # all ranks start together, so a rank that does not wait enters early
        start = time.monotonic()
        with rank_zero_first(local=local):
            entered_after_s = time.monotonic() - start
            ready_at_entry = flag.exists()
            if get_rank() == 0:
                time.sleep(1.0)
                flag.write_text("ready")
        result[name] = {"ready_at_entry": ready_at_entry, "entered_after_s": entered_after_s}
    return result


@rank_zero_only
def _only_on_rank_zero(rank: int) -> str:
    return f"ran-on-{rank}"


def case_collectives(out: Path) -> dict[str, Any]:
    """Rank queries and every object collective, recorded for the test to compare."""
    rank, world_size = get_rank(), get_world_size()
    result: dict[str, Any] = {
        "rank": rank,
        "world_size": world_size,
        "local_rank": get_local_rank(),
        "is_master": is_master(),
    }
    barrier()
    result["barrier_returned"] = True
    result["group_initialized"] = dist.is_initialized()
    result["is_distributed"] = is_distributed()
    result["gathered"] = all_gather_object({"rank": rank})
    result["broadcast"] = broadcast_object({"from": rank, "payload": [1, 2, 3]})
    result["broadcast_from_last"] = broadcast_object(f"from-{rank}", src=world_size - 1)
    result["rank_zero_only"] = _only_on_rank_zero(rank)
    result["all_reduce_sum"] = all_reduce_sum(torch.tensor([rank + 1.0])).item()
    result["rank_after"], result["world_size_after"] = get_rank(), get_world_size()
    return result


def case_fail(out: Path) -> dict[str, Any]:
    """The last rank raises; the others finish normally."""
    print(f"fail-case-rank-{get_rank()}-started", flush=True)
    if get_rank() == get_world_size() - 1:
        raise RuntimeError(f"deliberate-failure-on-rank-{get_rank()}")
    return {}


def case_hang(out: Path) -> dict[str, Any]:
    """Write this process's pid to OUT_DIR/pid<R>, then sleep forever."""
    (out / f"pid{get_rank()}").write_text(str(os.getpid()))
    print(f"hang-case-rank-{get_rank()}-sleeping", flush=True)
    while True:
        time.sleep(60)


CASES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "logger": case_logger,
    "rank_zero_first": case_rank_zero_first,
    "collectives": case_collectives,
    "fail": case_fail,
    "hang": case_hang,
}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not set(argv[1].split(",")) <= CASES.keys():
        print(f"usage: {argv[0]} CASE[,CASE...] OUT_DIR; cases: {', '.join(CASES)}")
        return 2
    out = Path(argv[2])
    results: dict[str, Any] = {
        "meta": {
            "rank": get_rank(),
            "world_size": get_world_size(),
            "local_rank": get_local_rank(),
            "group_at_start": dist.is_initialized(),
            "torchrun": "TORCHELASTIC_RUN_ID" in os.environ,
        }
    }
    for case in argv[1].split(","):
        results[case] = CASES[case](out)
    path = out / f"rank{get_rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
