"""Noting a SIGTERM (pre-emption, or torchrun stopping the job) or SLURM's requeue signal
instead of dying at once."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from fastdist.distributed.slurm import requeue_job, requeue_signal
from fastdist.logging import logger

#: Seconds a rank waits, after SIGTERM, for the ranks to agree to stop (at the next log step,
#: evaluation or checkpoint) before it exits on its own: less than the 30 s torchrun leaves
#: before SIGKILL, which it sends once a rank failed and the others are stopped.
GRACE_S = 20.0
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
        self._deadline: threading.Timer | None = None
        self._settled = False

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
        watched = [signal.SIGTERM] + ([self.requeue_signal] if self.requeue_signal else [])
        previous = {signum: signal.signal(signum, note) for signum in watched}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.settle()

    def settle(self) -> None:
        """The ranks agreed to stop (or training is over): no deadline any more."""
        self._settled = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


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
