"""Noting a SIGTERM (pre-emption, or torchrun stopping the job) or SLURM's requeue signal
instead of dying at once."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from fastdist.distributed.slurm import requeue_job, requeue_signal
from fastdist.logging import logger

#: Seconds a rank waits, after SIGTERM, for the ranks to agree to stop (at the next sync point)
#: before it exits on its own: less than the 30 s torchrun leaves before SIGKILL, which it
#: sends once a rank failed and the others are stopped.
GRACE_S = 20.0
#: Seconds of training, at most, between two sync points that agree on the signals: where log
#: steps are further apart, the ranks also check in between (a few numbers, one all-reduce), so
#: that a signal is acted on well within torchrun's 30 s ``--shutdown-timeout``.
CHECK_S = 5.0
#: The exit code of a rank stopped by SIGTERM: 128 + 15, as if killed by the signal.
SIGTERM_EXIT_CODE = 143


class SigtermFlag:
    """``with flag.watching():`` sets ``flag.received`` on SIGTERM, and also ``flag.requeue``
    on the requeue signal of a SLURM job (see
    :func:`~fastdist.distributed.slurm.requeue_signal`, read when the flag is made: a bad
    ``FASTDIST_REQUEUE_SIGNAL`` raises alike on every rank); the old handlers return
    afterwards. Outside the main thread (where signals cannot be handled) it watches nothing.

    The ranks act on the flag once they agree at a sync point. A rank that has not agreed
    :data:`GRACE_S` seconds after SIGTERM (a peer died, or this rank is stuck far from a sync
    point) logs why and exits with :data:`SIGTERM_EXIT_CODE`; :meth:`settle` cancels that. The
    requeue signal sets no such deadline: it comes early (``--signal=B:USR1@90``: 90 s before
    the time limit), and the time limit bounds the wait.
    """

    def __init__(self) -> None:
        self.received = False
        self.requeue = False
        self.requeue_signal = requeue_signal()
        self.checks = SignalChecks()
        self._deadline: threading.Timer | None = None
        self._settled = False
        self._exiting = False

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum: int, frame: Any) -> None:
            self.received = True
            if signum != signal.SIGTERM:
                self.requeue = True
            elif self._deadline is None and not self._settled:  # the first SIGTERM
                self._deadline = threading.Timer(GRACE_S, _give_up)
                self._deadline.daemon = True
                self._deadline.start()

        self._settled = False
        self.checks = SignalChecks()  # a new run sets its own pace
        watched = [signal.SIGTERM] + ([self.requeue_signal] if self.requeue_signal else [])
        previous = {signum: signal.signal(signum, note) for signum in watched}
        try:
            yield
        finally:
            if not self._exiting:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
            self.settle()

    @property
    def exiting(self) -> bool:
        """Whether :meth:`exit` was called (its ``SystemExit`` is no failure)."""
        return self._exiting

    def settle(self) -> None:
        """The ranks agreed to stop (or training is over): no deadline any more."""
        self._settled = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def exit(self) -> NoReturn:
        """End the process with :data:`SIGTERM_EXIT_CODE` after the pre-emption checkpoint.

        The signals stay ignored until the process is gone: torchrun sends SIGTERM to the ranks
        still running once one has exited, and it must not turn their 143 into -15.
        """
        self._exiting = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.requeue_signal:
            signal.signal(self.requeue_signal, signal.SIG_IGN)
        raise SystemExit(SIGTERM_EXIT_CODE)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[Callable[[], bool]]:
    """Hold a SIGTERM back while the block runs (the failure report: torchrun sends one to the
    other ranks as soon as one died), then deliver it to the handler that was in place: by
    default it ends the process, as it would have. Not a ``SystemExit``, which a script may
    take for a pre-emption. It gives the block whether a SIGTERM came. SIGCHLD is ignored
    meanwhile: the DataLoader's handler raises in the main thread when a worker process died,
    and the SIGTERM kills them. Outside the main thread it holds nothing back."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    children = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL if children is None else children)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if received:
            sys.stdout.flush()
            sys.stderr.flush()
            signal.raise_signal(signal.SIGTERM)


class SignalChecks:
    """When the ranks next agree on the signals between log steps.

    At every sync point rank 0 proposes the update about :data:`CHECK_S` seconds of training
    ahead, from its own pace since the last proposal, and at most twice as far as that
    interval; the sync's all-reduce (a sum, to which the other ranks give 0) brings the same
    step to every rank. The first check comes after the second update of a run.
    """

    def __init__(self) -> None:
        self.next_step: int | None = None
        self._mark: tuple[float, int] | None = None  # rank 0's (time, step) of the last proposal

    def due(self, step: int) -> bool:
        """Whether the ranks check for signals after update ``step`` (the same on every rank)."""
        if self.next_step is None:
            self.next_step, self._mark = step + 1, (time.monotonic(), step)
        return step >= self.next_step

    def proposal(self, step: int, rank: int) -> float:
        """This rank's share of the next check's step (rank 0's proposal; 0 elsewhere)."""
        if rank != 0:
            return 0.0
        now = time.monotonic()
        if self._mark is None:  # nothing measured yet: check after the next update
            self._mark = (now, step)
            return float(step + 1)
        if step <= self._mark[1] and self.next_step is not None:  # no update since: no new pace
            return float(self.next_step)
        since = max(step - self._mark[1], 1)
        pace = (now - self._mark[0]) / since  # seconds per update
        self._mark = (now, step)
        # At most twice as far as the last interval: a pace that slows down is seen soon.
        return float(step + max(1, min(int(CHECK_S / max(pace, 1e-9)), 2 * since)))

    def agreed(self, next_step: float) -> None:
        """The step the sync's all-reduce brought: the next check."""
        self.next_step = int(next_step)


def report_preempted(step: int, path: str | None, is_master: bool) -> None:
    """Log, on every rank, what rank 0 did at the pre-emption (``path``: what it wrote, which
    every rank learned from it after the write, or ``None``)."""
    if path is None:
        logger.warning(
            "pre-empted at step %d without a checkpoint (no save_path or checkpoint_dir): a "
            "new run starts over",
            step,
        )
    elif is_master:
        logger.warning("pre-empted: checkpoint written at step %d: %s", step, path)
    else:
        logger.warning("pre-empted at step %d: rank 0 wrote the checkpoint %s", step, path)


def requeue(is_master: bool, checkpointed: bool) -> None:
    """After the requeue signal's checkpoint: rank 0 requeues the SLURM job, which resumes from
    that checkpoint when it runs again. A run without checkpoints is not requeued: it would
    start from the beginning each time."""
    if not is_master:
        return
    if not checkpointed:
        logger.warning(
            "the requeue signal came, but this run writes no checkpoints (no save_path or "
            "checkpoint_dir): the SLURM job is not requeued, as it would start over"
        )
        return
    requeue_job()


def _give_up() -> None:
    logger.error(
        "SIGTERM received %.0f s ago and the ranks have not agreed to stop: a peer is gone, or "
        "the next log step (print_every) is further away than that; exiting with %d, without a "
        "checkpoint",
        GRACE_S,
        SIGTERM_EXIT_CODE,
    )
    sys.stderr.flush()
    os._exit(SIGTERM_EXIT_CODE)
