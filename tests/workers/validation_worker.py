"""Worker for tests/test_validation.py: ``DistTrainer`` given bad input, in a real world.

Usage (under torchrun or as a plain process)::

    validation_worker.py bad_input OUT_DIR
    validation_worker.py non_scalar_loss OUT_DIR

``bad_input`` constructs one trainer per case of :data:`BAD_INPUT`, each of which must raise;
it records the exception and whether a process group exists afterwards, writes
``OUT_DIR/rank<R>.json`` and exits 0. ``non_scalar_loss`` trains with a loss that returns one
value per sample: it records the exception in ``OUT_DIR/rank<R>.json``, waits (without any
collective) until every rank has, then re-raises it, so the launch must fail.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from trainer_worker import ToyData, ToyNet, make_trainer, write_json

from fastdist import DDP, FSDP, AccuracyMetric
from fastdist.distributed import get_world_size


def _foreign_optimizer() -> dict[str, Any]:
    return {"optimizer": torch.optim.SGD(ToyNet().parameters(), lr=0.1)}


# case -> keyword arguments of make_trainer (a callable to build them lazily). The last case
# leaves each rank fewer samples than one batch with drop_last=True (2 ranks x 4 < 8).
BAD_INPUT: dict[str, dict[str, Any] | Callable[[], dict[str, Any]]] = {
    "batch_size_per_gpu": {"batch_size_per_gpu": 0},
    "update_every": {"update_every": 0},
    "n_epochs": {"n_epochs": 0},
    "metric_key": {"dev_data": ToyData(10), "metrics": AccuracyMetric(), "metric_key": "f1"},
    "dev_data_without_metrics": {"dev_data": ToyData(10)},
    "foreign_optimizer": _foreign_optimizer,
    "empty_train_data": {"n_train": 0},
    "unknown_keyword": {"batch_size": 8},
    "too_few_samples_for_drop_last": {"n_train": 8, "drop_last": True},
    "unknown_strategy": {"strategy": "deepspeed"},
    "flat_ddp_keyword": {"bucket_cap_mb": 50},
    "flat_comm_hook": {"ddp_comm_hook": "fp16"},
    "flat_fsdp_wrap": {"fsdp_wrap": [torch.nn.Linear]},
    "comm_hook_with_average_every": lambda: {"strategy": DDP(comm_hook="fp16", average_every=4)},
    "fsdp_wrap_absent": lambda: {"strategy": FSDP(wrap=[torch.nn.Conv2d])},
    "cpu_offload_on_cpu": lambda: {"strategy": FSDP(cpu_offload=True)},
}


def case_bad_input(out: Path) -> None:
    results: dict[str, Any] = {}
    for name, spec in BAD_INPUT.items():
        try:  # a strategy object checks its options when it is built, in the spec
            kwargs = dict(spec() if callable(spec) else spec)
            make_trainer(kwargs.pop("n_train", 32), **kwargs)
        except Exception as exc:
            error: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
        else:
            error = {"type": None, "message": "no exception"}
        error["group_after"] = dist.is_initialized()
        results[name] = error
    write_json(out, results)


def case_non_scalar_loss(out: Path) -> None:
    def per_sample_loss(output: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(output, batch["target"], reduction="none")

    trainer = make_trainer(32, loss=per_sample_loss, update_every=2)
    try:
        trainer.train()
    except Exception as exc:
        write_json(
            out,
            {
                "type": type(exc).__name__,
                "message": str(exc),
                "global_step": trainer.state.global_step,
                "batch_idx": trainer.state.batch_idx,
            },
        )
        deadline = time.monotonic() + 20
        ranks = [out / f"rank{rank}.json" for rank in range(get_world_size())]
        while not all(path.exists() for path in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise
    write_json(out, {"type": None, "message": "training succeeded"})


CASES: dict[str, Callable[[Path], None]] = {
    "bad_input": case_bad_input,
    "non_scalar_loss": case_non_scalar_loss,
}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in CASES:
        print(f"usage: {argv[0]} CASE OUT_DIR; cases: {', '.join(CASES)}")
        return 2
    CASES[argv[1]](Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
