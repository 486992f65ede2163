"""What rank 0 shows while training: a tqdm bar on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from fastdist.logging import logger


def log_plan(
    world: Any, global_batch: int, per_process: int, update_every: int, total: int | None
) -> None:
    """Log the run's shape: processes, device, the global batch and the updates to make."""
    shards = world.data.size
    logger.info(
        "training on %d process(es), %s; global batch %d = %d per process x %d%s x "
        "update_every %d; %s updates",
        world.size,
        world.device,
        global_batch,
        per_process,
        shards,
        ""
        if shards == world.size
        else " data shards (a pipeline's stages and tensor-parallel peers share one)",
        update_every,
        "unknown (a stream)" if total is None else total,
    )


class Progress:
    """A bar of optimizer updates (epoch, loss, learning rate, samples/s, ETA) on rank 0.

    When stderr is not a terminal (CI, ``nohup``, cluster logs) or ``use_tqdm`` is off, every
    log step is one plain line instead of carriage-return noise. Other ranks show nothing.
    """

    def __init__(
        self, show: bool, use_tqdm: bool, total: int | None, initial: int, global_batch: int
    ) -> None:
        self.global_batch = global_batch
        self.bar: tqdm | None = None
        if show and use_tqdm and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=initial, unit="update", dynamic_ncols=True)
        self._time, self._step = time.monotonic(), initial
        self._marked: dict[int, tuple[float, float]] = {}  # log step -> its time, its rate

    def update(self) -> None:
        """One optimizer update done."""
        if self.bar is not None:
            self.bar.update()

    def mark(self, step: int, lr: float) -> None:
        """Log step ``step`` is done now, at learning rate ``lr``; its loss comes later."""
        self._marked[step] = time.monotonic(), lr

    def log(self, epoch: int, step: int, total: int | None, loss: float) -> None:
        """Show the mean loss of marked log step ``step``, its rate and the throughput since
        the previous one."""
        now, lr = self._marked.pop(step)
        self._marked = {s: mark for s, mark in self._marked.items() if s > step}
        seconds, steps = now - self._time, step - self._step
        samples_per_s = self.global_batch * steps / seconds if seconds > 0 else 0.0
        self._time, self._step = now, step
        if self.bar is not None:
            self.bar.set_postfix(
                epoch=epoch, loss=f"{loss:.4f}", lr=f"{lr:.3g}", samples_s=f"{samples_per_s:.0f}"
            )
        else:
            logger.info(
                "epoch %d step %d/%s loss %.4f lr %.3g %.0f samples/s",
                epoch,
                step,
                "?" if total is None else total,
                loss,
                lr,
                samples_per_s,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
