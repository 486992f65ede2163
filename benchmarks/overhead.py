"""Per-update cost of fastdist's loop itself, without communication: one process, no DDP.

With one process ``DistTrainer`` does not wrap the model in DDP, so this compares its loop with
the same hand-written loop (no DDP either) on the tiny MLP, alternating in one process, and
reports microseconds per optimizer update.

Run: ``python benchmarks/overhead.py [--updates N] [--repeats R]``; ``run.py`` runs it too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(_name, None)  # a world of one process, whoever launched us

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402
from workloads import (  # noqa: E402
    SAMPLER_SEED,
    WORKLOADS,
    build_data,
    build_model,
    build_optimizer,
)

BATCH = WORKLOADS["tiny"].batch_size


def hand_loop(data: TensorDataset, updates: int) -> float:
    """Seconds per update of the hand loop (no DDP: one process)."""
    model = build_model(WORKLOADS["tiny"])
    optimizer = build_optimizer(model)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=SAMPLER_SEED)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    epochs = -(-updates // len(loader))
    start, step = 0.0, 0
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step == 10:
                start = time.perf_counter()
            loss = loss_fn(model(x), y) / 1
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
    return (time.perf_counter() - start) / (step - 10)


def fastdist_loop(data: TensorDataset, updates: int) -> float:
    """Seconds per update of ``DistTrainer`` on the same model and data (one process)."""
    from fastdist import DistTrainer
    from fastdist.callbacks import Callback

    marks: dict[str, float] = {}

    class Timer(Callback):
        def on_step_end(self) -> None:
            if self.trainer.state.global_step == 10:
                marks["start"] = time.perf_counter()

        def on_train_end(self) -> None:
            marks["end"] = time.perf_counter()

    model = build_model(WORKLOADS["tiny"])
    n_batches = -(-len(data) // BATCH)
    trainer = DistTrainer(
        train_data=data,
        model=model,
        optimizer=build_optimizer(model),
        loss=nn.CrossEntropyLoss(),
        callbacks_all=[Timer()],
        batch_size_per_gpu=BATCH,
        n_epochs=-(-updates // n_batches),
        print_every=10**9,
        device="cpu",
        use_tqdm=False,
        seed=SAMPLER_SEED,
        load_best_model=False,
    )
    trainer.train()
    return (marks["end"] - marks["start"]) / (trainer.state.global_step - 10)


def measure(updates: int, repeats: int) -> dict[str, Any]:
    """Alternate the loops ``repeats`` times; medians in microseconds per update."""
    data = build_data(WORKLOADS["tiny"], 64 * BATCH)
    cases: dict[str, Callable[[], float]] = {
        "hand (no DDP)": lambda: hand_loop(data, updates),
        "fastdist": lambda: fastdist_loop(data, updates),
    }
    times: dict[str, list[float]] = {label: [] for label in cases}
    fastdist_loop(data, 50)  # warm up imports and allocator
    for _ in range(repeats):
        for label, fn in cases.items():
            times[label].append(fn() * 1e6)
    medians = {label: statistics.median(v) for label, v in times.items()}
    return {"us_per_update": medians, "updates": updates, "repeats": repeats}


def report(result: dict[str, Any]) -> None:
    """Print the medians and the differences to the hand loop."""
    medians = result["us_per_update"]
    hand = medians["hand (no DDP)"]
    print(
        f"loop overhead, 1 process, no DDP, tiny MLP, batch {BATCH} (median of "
        f"{result['repeats']} x {result['updates']} updates):"
    )
    for label, us in medians.items():
        print(f"  {label:<60}{us:8.1f} us/update  ({us - hand:+.1f} vs hand)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--updates", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.updates, args.repeats)
    report(result)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
