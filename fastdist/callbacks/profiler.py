"""Profile a window of optimizer updates with ``torch.profiler``: a trace per rank."""

from __future__ import annotations

import os
from typing import Any

from torch.profiler import ProfilerActivity, profile, schedule

from fastdist.callbacks.callback import Callback
from fastdist.checks import check_int
from fastdist.logging import logger


class ProfilerCallback(Callback):
    """Run ``torch.profiler`` over updates ``wait + warmup + 1`` to ``wait + warmup + active``.

    Put it in ``callbacks_all``: each rank profiles itself and writes its own trace,
    ``<dir>/rank<R>.pt.trace.json`` (Chrome trace JSON: open it in https://ui.perfetto.dev,
    ``chrome://tracing``, or ``tensorboard --logdir DIR`` with the ``torch-tb-profiler``
    plugin). It makes no collectives, so it may run on every rank; in ``callbacks_master`` it
    profiles rank 0 only. Rank 0 also logs a table of the ``row_limit`` operators that took
    the most time of their own (CUDA time on a GPU, else CPU time).

    The profiler counts optimizer updates (``on_step_end``): it skips ``wait`` updates,
    records but discards ``warmup`` (profiler start-up costs), then records ``active`` ones.
    Training that ends inside the window writes what was recorded so far.

    Args:
        wait: updates to skip before warming up.
        warmup: updates traced and thrown away.
        active: updates traced and written.
        dir: directory of the traces (created if missing).
        row_limit: rows of the top-operators table (0: no table).
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.

    Example:
        >>> profiler = ProfilerCallback(wait=10, active=5, dir="prof")  # in callbacks_all
    """

    def __init__(
        self,
        wait: int = 5,
        warmup: int = 1,
        active: int = 3,
        dir: str | os.PathLike[str] = "profile",
        row_limit: int = 15,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        check_int("wait", wait, minimum=0)
        check_int("warmup", warmup, minimum=0)
        check_int("active", active, minimum=1)
        self.wait, self.warmup, self.active = wait, warmup, active
        self.dir = os.fspath(dir)
        self.row_limit = row_limit
        self.record_shapes, self.profile_memory, self.with_stack = (
            record_shapes,
            profile_memory,
            with_stack,
        )
        self.profiler: profile | None = None
        self.trace_path: str | None = None  # this rank's trace, once written

    def on_train_begin(self) -> None:
        self.close()
        activities = [ProfilerActivity.CPU]
        if self.trainer.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self.profiler.start()

    def on_step_end(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_train_end(self) -> None:
        self.close()

    def on_exception(self, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Stop profiling (writing the trace if the window was open)."""
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _write(self, profiler: Any) -> None:
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, f"rank{self.trainer.rank}.pt.trace.json")
        profiler.export_chrome_trace(path)
        self.trace_path = path
        if self.trainer.rank == 0 and self.row_limit:
            on_gpu = self.trainer.device.type == "cuda"
            sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
            logger.info("profile of %d updates, trace in %s:\n%s", self.active, path, table)
