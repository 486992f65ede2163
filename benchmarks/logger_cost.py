"""Each logging backend's host time per logged step, for ``overhead.py --loggers``.

One process (no process group), the tiny MLP of ``workloads.py``, ``print_every=1`` so every
update is a log step (a ``"train"`` record: about 10 scalars with one rank's timings). Each
backend is timed inside its own ``open`` and ``write`` calls (wall clock), alone, on a fresh
directory; rounds alternate the backends' order. The trainer's own cost of building a record
is the ``none`` row (a backend that writes nothing).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from workloads import WORKLOADS, build_data, build_model, build_optimizer

import fastdist
from fastdist import DistTrainer
from fastdist.loggers import (
    FitlogLogger,
    JsonLogger,
    Logger,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
)

STEPS, BATCH = 200, 32
BACKENDS: dict[str, Callable[[str], Logger]] = {
    "none": lambda d: Logger(),
    "json": lambda d: JsonLogger(os.path.join(d, "log.jsonl")),
    "tensorboard": lambda d: TensorBoardLogger(os.path.join(d, "tb")),
    "fitlog": lambda d: FitlogLogger(os.path.join(d, "fitlog")),
    "mlflow": lambda d: MLflowLogger(f"sqlite:///{d}/mlflow.db", experiment="bench"),
    "wandb": lambda d: WandbLogger(project="bench", mode="offline", dir=d),
}


def timed(backend: Logger, spent: dict[str, list[float]]) -> None:
    """Make ``backend`` record the seconds of each of its ``open`` and ``write`` calls."""
    for name in ("open", "write"):
        call = getattr(backend, name)

        def clocked(*args: Any, _call: Any = call, _name: str = name) -> None:
            start = time.perf_counter()
            _call(*args)
            spent[_name].append(time.perf_counter() - start)

        setattr(backend, name, clocked)


def one_run(name: str) -> tuple[float, float]:
    """(seconds to open, microseconds per logged step) of backend ``name``."""
    wl = WORKLOADS["tiny"]
    with tempfile.TemporaryDirectory() as directory:
        backend = BACKENDS[name](directory)
        spent: dict[str, list[float]] = {"open": [], "write": []}
        timed(backend, spent)
        model = build_model(wl)
        DistTrainer(
            train_data=build_data(wl, STEPS * BATCH),
            model=model,
            optimizer=build_optimizer(model),
            loss=fastdist.CrossEntropyLoss(),
            batch_size_per_gpu=BATCH,
            print_every=1,
            loggers=[backend],
            use_tqdm=False,
            device="cpu",
            load_best_model=False,
        ).train()
        writes = spent["write"][1:-1]  # without "start" and "end"
        return spent["open"][0], statistics.median(writes) * 1e6


def measure(rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Every backend ``rounds`` times, the order reversed every other round."""
    fastdist.logger.setLevel("WARNING")
    os.environ.setdefault("WANDB_SILENT", "true")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in BACKENDS}
    for round_ in range(rounds):
        for name in sorted(BACKENDS, reverse=round_ % 2 == 1):
            results[name].append(one_run(name))
    return results


def report(results: dict[str, list[tuple[float, float]]]) -> None:
    rounds = len(next(iter(results.values())))
    print(f"logging backends, 1 process, print_every=1; medians of {rounds} rounds (min..max)")
    print(f"{'backend':<13}{'us per logged step':>24}{'open s':>16}")
    for name, runs in results.items():
        per_step = [us for _, us in runs]
        opened = statistics.median(s for s, _ in runs)
        low, high = min(per_step), max(per_step)
        median = statistics.median(per_step)
        spread = f"({low:.0f}..{high:.0f})"
        print(f"{name:<13}{median:10.0f} {spread:<19}{opened:10.2f}")
