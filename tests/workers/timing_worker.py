"""Worker for tests/test_timing.py: per-rank timings, the slow-rank report and the profiler.

Usage (under torchrun or as a plain process)::

    timing_worker.py OUT_DIR

Case ``slow``: rank 1's ``collate_fn`` sleeps 30 ms per micro-batch; 12 updates with
``print_every=2`` and ``save_path=OUT_DIR/slow`` (so ``OUT_DIR/slow/log.jsonl``), counting the
all-reduces. Case ``profile``: ``ProfilerCallback`` in ``callbacks_all`` writes its traces to
``OUT_DIR/profile``. Case ``log_step``: the log step's agreement read one update late: the
logged losses and steps (``OUT_DIR/log_step/log.jsonl``), a stop requested by the last rank,
a NaN on the last rank before an evaluation. Each rank writes what it saw to
``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, default_collate
from trainer_worker import BATCH, CommCounter, ToyData, ToyNet, make_trainer, warnings_logged
from workers.ending import exit_now

import fastdist
from fastdist import AccuracyMetric, DistTrainer
from fastdist.callbacks import Callback, ProfilerCallback
from fastdist.distributed import all_gather_object, get_rank, get_world_size

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


LOG_UPDATES, LOG_EVERY = 12, 3  # per epoch, as in tests/test_timing.py


class Seen(Callback):
    """Each update's loss (read on the host: a test), the ``(global_step, loss_step)`` each
    ``on_step_end`` sees; the last rank requests a stop in ``on_step_end`` of ``stop_at``."""

    def __init__(self, stop_at: int = 0) -> None:
        self.stop_at = stop_at
        self.losses: dict[int, float] = {}
        self.seen: list[tuple[int, int | None]] = []

    def on_backward_begin(self, loss: Any) -> None:
        self.losses[self.trainer.state.global_step + 1] = loss.item()

    def on_step_end(self) -> None:
        state = self.trainer.state
        self.seen.append((state.global_step, state.loss_step))
        if state.global_step == self.stop_at and get_rank() == get_world_size() - 1:
            self.trainer.request_stop()


class NaNNet(ToyNet):
    """The last rank's training forward number ``at`` returns NaN."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.calls += self.training
        last = get_rank() == get_world_size() - 1
        return out * float("nan") if last and self.training and self.calls == self.at else out


def case_log_step(out: Path) -> dict[str, Any]:
    """The log step's agreement, read one update late: the logged values and steps, a stop
    requested while one is under way, a NaN before an evaluation (last: it raises)."""
    n = LOG_UPDATES * BATCH * get_world_size()
    seen = Seen()
    logged = make_trainer(
        n, n_epochs=2, print_every=LOG_EVERY, callbacks_all=[seen], save_path=str(out / "log_step")
    )
    logged.train()
    stop = Seen(stop_at=LOG_EVERY)  # requested after log step 3 began: sent with step 6's
    stopped = make_trainer(n, print_every=LOG_EVERY, callbacks_all=[stop]).train()["steps"]
    nan = make_trainer(
        n,
        NaNNet(at=5),
        print_every=LOG_EVERY,
        dev_data=ToyData(16),
        metrics=AccuracyMetric(),
        validate_every=7,
        save_path=str(out / f"nan{get_rank()}"),
    )
    nan_error = _raised(nan)
    # A NaN after the last log step (10) is read at the end of training (update 12), where
    # the parameters it made NaN are checked too: the loss is named, with its update.
    late_nan = make_trainer(n, NaNNet(at=LOG_UPDATES - 1), print_every=10)
    return {
        "losses": all_gather_object(seen.losses),
        "seen": seen.seen,
        "stopped": stopped,
        "nan_error": nan_error,
        "late_nan_error": _raised(late_nan),
        "nan_files": sorted(p.name for p in (out / f"nan{get_rank()}").iterdir()),
    }


def _raised(trainer: DistTrainer) -> str:
    """The ``FloatingPointError`` ``trainer.train()`` raised (``""``: none)."""
    try:
        trainer.train()
    except FloatingPointError as exc:
        return str(exc)
    return ""


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, and the host reads among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default  # .item(), bool()
        return func(*args, **(kwargs or {}))


def _count_ops(prepare: Callable[[int], Callable[[], None]], updates: int) -> tuple[int, ...]:
    """Aten ops, host reads and calls of fastdist's Python functions (generators resumed
    included) of training ``updates`` updates (the set-up not counted)."""
    train, counter, calls = prepare(updates), OpCounter(), [0]
    package = os.path.dirname(fastdist.__file__) + os.sep

    def count(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[0] += 1

    with counter:
        sys.setprofile(count)
        try:
            train()
        finally:
            sys.setprofile(None)
    return counter.ops, counter.reads, calls[0]


def case_ops() -> dict[str, Any]:
    """Aten ops and host reads of 4 and 12 updates of 4 micro-batches (the difference leaves
    the start and the end out), by DistTrainer and by a hand-written loop on the same model
    and data."""
    k, batch, world = 4, 4, get_world_size()
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(12 * k * batch * world, 8, generator=gen),
        torch.zeros(12 * k * batch * world, dtype=torch.long),
    )

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(8, 2)

    def fastdist_loop(updates: int) -> Callable[[], None]:
        net = model()
        trainer = DistTrainer(
            torch.utils.data.Subset(data, range(updates * k * batch * world)),
            net,
            torch.optim.SGD(net.parameters(), lr=0.1),
            loss=torch.nn.CrossEntropyLoss(),
            batch_size_per_gpu=batch,
            update_every=k,
            print_every=10**6,
            use_tqdm=False,
            device="cpu",
            load_best_model=False,
        )
        return lambda: trainer.train() and None

    def hand_loop(updates: int) -> Callable[[], None]:
        net = model()
        ddp = DistributedDataParallel(net) if world > 1 else net
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        subset = torch.utils.data.Subset(data, range(updates * k * batch * world))
        sampler = DistributedSampler(subset, shuffle=False) if world > 1 else None
        loss_fn = torch.nn.CrossEntropyLoss()

        def train() -> None:
            for i, (x, y) in enumerate(DataLoader(subset, batch, sampler=sampler)):
                last = (i + 1) % k == 0
                with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():
                    (loss_fn(ddp(x), y) / k).backward()
                if last:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

        return train

    counts = {}
    for name, loop in (("fastdist", fastdist_loop), ("hand", hand_loop)):
        counts[name] = [_count_ops(loop, n) for n in (4, 12)]
    return {"counts": counts, "micro_batches": 8 * k}


def main() -> None:
    out = Path(sys.argv[1])
    results = {"slow": case_slow(out), "profile": case_profile(out), "ops": case_ops()}
    if get_world_size() > 1:
        results.update(fsdp=case_fsdp(out), healthy=case_healthy())
    results["log_step"] = case_log_step(out)  # last: its NaN run raises
    (out / f"rank{get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    exit_now()
