"""fastdist's own host time per micro-batch and per update, in one process, where it is steady.

Run on demand from the repository root (CPU, no process group)::

    python benchmarks/micro_batch.py [--rounds 9] [--updates 300]

``overhead.py`` times the same thing at 2 ranks, where a round's difference moves by hundreds
of microseconds on a shared 2-core VM. Here both loops train a ``Linear(8, 2)`` on batches of 4
that are made before the run: the DataLoader only hands them on (a dataset of whole batches,
``batch_size_per_gpu=1``, a collate that unwraps the one item), so the data path costs both
loops the same few microseconds and the model almost nothing. What is left is each loop's own
work. Each round trains ``--updates`` updates of 1 and of 16 micro-batches by hand and with
``DistTrainer`` (defaults, ``print_every=10``), alternately, and times the training thread's
CPU (``time.thread_time``) from the first update to the end. The minimum over the rounds
estimates each loop's undisturbed time (noise only ever adds); fastdist's own cost is the
difference of the minima, split into a part per micro-batch ((16 - 1) / 15) and one per
update. (With windows of 4 the split moved by 20 us between runs; with 16, by 3.)

Then the update path alone, steadier still: the strategy's ``forward_backward`` of a trainer
(reached through its private parts: this line follows the code, not the API) over windows of 4
pre-drawn micro-batches, against the hand loop's body on the same batches, no DataLoader and no
optimizer step in either; the minimum over the rounds, in us per micro-batch.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import alternating  # noqa: E402
from fastdist import Callback, DistTrainer  # noqa: E402

BATCH = 4
WINDOW = 16  # micro-batches per update of the split's long runs


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(BATCH, 8, generator=gen), torch.randint(0, 2, (BATCH,), generator=gen))
        for _ in range(n)
    ]


def unwrap(items: list[Any]) -> Any:
    return items[0]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(8, 2)


def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


class Clock(Callback):
    """The training thread's CPU seconds from ``on_train_begin`` to ``on_train_end``."""

    def on_train_begin(self) -> None:
        self.start = time.thread_time()

    def on_train_end(self) -> None:
        self.seconds = time.thread_time() - self.start


def hand(data: list[Any], k: int) -> float:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    start = time.thread_time()
    for i, (x, y) in enumerate(DataLoader(data, batch_size=1, collate_fn=unwrap)):
        (F.cross_entropy(net(x), y) / k).backward()
        if (i + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return time.thread_time() - start


def fastdist_loop(data: list[Any], k: int) -> float:
    net, clock = model(), Clock()
    DistTrainer(
        data,
        net,
        torch.optim.SGD(net.parameters(), lr=0.01),
        loss=loss_fn,
        batch_size_per_gpu=1,
        collate_fn=unwrap,
        update_every=k,
        use_tqdm=False,
        device="cpu",
        callbacks_all=[clock],
        load_best_model=False,
    ).train()
    return clock.seconds


def update_path(data: list[Any]) -> tuple[float, float]:
    """CPU us per micro-batch of the hand loop's body and of fastdist's update path (windows
    of 4) on ``data``, drawn already."""
    from fastdist.trainer.update import Update

    net = model()
    trainer = DistTrainer(
        data, net, torch.optim.SGD(net.parameters(), lr=0.01), loss=loss_fn,
        batch_size_per_gpu=1, collate_fn=unwrap, update_every=4, use_tqdm=False, device="cpu",
    )  # fmt: skip
    loop = trainer._loop
    start = time.thread_time()
    for i, (x, y) in enumerate(data):
        (F.cross_entropy(net(x), y) / 4).backward()
        if (i + 1) % 4 == 0:
            net.zero_grad(set_to_none=True)
    by_hand = time.thread_time() - start
    loop.data.begin(1, 0, 0)
    drawn = iter(data)
    update = Update(loop.run, drawn, loop.training_modes)
    start = time.thread_time()
    for first in drawn:
        loop.strategy.forward_backward(update.open(first))
        loop.run.losses.end_window(True)
        net.zero_grad(set_to_none=True)
    return by_hand / len(data) * 1e6, (time.thread_time() - start) / len(data) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--updates", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loops: dict[str, Callable[[list[Any], int], float]] = {"hand": hand, "fastdist": fastdist_loop}
    us: dict[tuple[str, int], list[float]] = {}
    for k in (1, WINDOW):
        data = batches(args.updates * k)
        rounds = alternating(
            {n: functools.partial(f, data, k) for n, f in loops.items()}, args.rounds
        )
        us |= {(name, k): [s / args.updates * 1e6 for s in t] for name, t in rounds.items()}
    print(f"one process, {args.rounds} rounds of {args.updates} updates; us per update:")
    print("micro-batches  loop       min     median")
    for (name, k), values in us.items():
        print(f"{k:13d}  {name:8} {min(values):7.1f} {statistics.median(values):8.1f}")
    extra = {k: min(us["fastdist", k]) - min(us["hand", k]) for k in (1, WINDOW)}
    each = (extra[WINDOW] - extra[1]) / (WINDOW - 1)
    print(f"fastdist's own: {extra[1]:.1f} us per update of 1, {extra[WINDOW]:.1f} of {WINDOW}")
    print(f"  per micro-batch {each:.1f} us, per update {extra[1] - each:.1f}")
    data = batches(args.updates * 4)
    paths = [update_path(data) for _ in range(args.rounds)]
    by_hand, fast = min(p[0] for p in paths), min(p[1] for p in paths)
    print(f"update path alone, us per micro-batch: hand {by_hand:.1f}, fastdist {fast:.1f}")
    print(f"  fastdist's own {fast - by_hand:.1f}")


if __name__ == "__main__":
    main()
