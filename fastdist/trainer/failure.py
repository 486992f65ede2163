"""Turning a failure on one rank into one readable report per rank, printed once."""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from fastdist.checks import first_line
from fastdist.distributed import hang
from fastdist.distributed.bounded import STORE_WAIT_S, within
from fastdist.distributed.env import note_failure
from fastdist.distributed.hang_report import describe
from fastdist.distributed.position import PositionBoard
from fastdist.logging import logger
from fastdist.state import TrainerState
from fastdist.trainer.preemption import sigterm_deferred

# What gloo and nccl put in the message of a collective that timed out or lost a peer.
_COLLECTIVE_MARKERS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset")


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective (timeout, lost peer) rather than this rank's code."""
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_MARKERS)
    )


def report_failure(exc: BaseException, board: PositionBoard, timeout: float | None) -> None:
    """Log where every rank is and what failed, once; the traceback only where it started.

    A rank whose own code raised logs the error with its traceback; a rank whose collective
    failed (a peer died, or the timeout expired) logs the collective error and the positions,
    which usually name the rank that is elsewhere; then the ranks that did not say within
    :data:`~fastdist.distributed.bounded.STORE_WAIT_S` that they failed too (dead, stuck or cut
    off: where all were in the same collective, only this names them); then the hang report:
    each rank's collective and Python line (:mod:`fastdist.distributed.hang`). Every wait on
    the store is bounded: its host may be cut off from this rank. A SIGTERM (torchrun's, once
    a rank died) waits until the report is logged (:func:`sigterm_deferred`, a few seconds).
    """
    with sigterm_deferred() as stopping:
        _report(exc, board, timeout, stopping)
        exc.fastdist_reported = True  # type: ignore[attr-defined]


def report_interrupt(
    exc: KeyboardInterrupt, state: TrainerState, saved: Any, tell: Callable[[BaseException], Any]
) -> None:
    """Log a Ctrl-C on this rank in one line, no traceback (the excepthook holds it back):
    where training stopped, and what is saved (``saved``: the checkpoint directory, if any);
    then ``tell`` the callbacks. torchrun's SIGTERM, which follows its SIGINT at once, waits
    until then; a second Ctrl-C meanwhile ends the process at once, quietly (exit code 130).
    Then the previous SIGINT handler is back (a notebook's kernel keeps its own)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, _quit_now) if main else None
    try:
        with sigterm_deferred():
            logger.warning(
                "training interrupted (KeyboardInterrupt: Ctrl-C) at epoch %d, update %d: %s",
                state.epoch,
                state.global_step,
                "the checkpoints saved so far are kept; train(resume='auto') goes on from the "
                "newest"
                if saved
                else "nothing was saved (no save_path or checkpoint_dir)",
            )
            exc.fastdist_reported = True  # type: ignore[attr-defined]
            tell(exc)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def _quit_now(signum: int, frame: Any) -> None:
    """A second Ctrl-C while the first is reported: exit now, as killed by SIGINT (130)."""
    os._exit(128 + signal.SIGINT)


def _report(
    exc: BaseException, board: PositionBoard, timeout: float | None, stopping: Callable[[], bool]
) -> None:
    note_failure(exc)
    hang.note_failure(exc)
    summary = f"{type(exc).__name__}: {exc}".strip()
    # A raising rank's own line: the traceback logged with it ends with the whole message
    # (a DataLoader worker's error carries the worker's traceback in it).
    first = f"{type(exc).__name__}: {first_line(exc, 2000)}".strip()
    board.publish_failure(first[:300])
    if is_collective_failure(exc):
        limit = f"{timeout:g} s (DistTrainer(timeout=...))" if timeout else "the group's timeout"
        headline = f"a collective failed on rank {board.rank} (waits are bounded by {limit})"
        logger.error("%s: %s\n%s", headline, summary, board.report())  # before torchrun's SIGTERM
        try:  # up to ANSWER_WAIT_S; none in a one-process world
            ask = lambda: hang.collect(board.world_size, stopping)  # noqa: E731
            records = within(hang.ANSWER_WAIT_S + 1, ask)
        except Exception:  # the store's host is out of reach: the report above stands
            records = {}
        silent = _silent(records, board)
        if silent:
            logger.error(
                "ranks that reported no failure within %g s (dead, stuck or cut off): %s",
                STORE_WAIT_S,
                silent,
            )
        if records:
            logger.error("%s:\n%s", _dumps(records), describe(records, board.world_size))
    else:
        logger.error("rank %d raised %s\n%s", board.rank, first, board.report(), exc_info=exc)


def _silent(records: dict[int, dict[str, Any]], board: PositionBoard) -> list[int]:
    """The other ranks that did not report a failure: dead, stuck or cut off. From the hang
    records where they came (a failed rank answers with its error), else from the store."""
    if not records:
        return board.silent_ranks(STORE_WAIT_S)
    others = (r for r in range(board.world_size) if r != board.rank)
    return [r for r in others if not records.get(r, {}).get("error")]


def _dumps(records: dict[int, dict[str, Any]]) -> str:
    """The hang report's headline: when its records were taken, where their files are (or why
    some could not be written: a read-only or full directory)."""
    where = hang.dump_dir_in_use()
    what = "each rank's collective and Python line as it answered, at the time on its line"
    if where is None:
        return f"{what} (no files: no save_path or ${hang.DIR_VAR})"
    failed = {r: record["dump_error"] for r, record in records.items() if record.get("dump_error")}
    if failed and len(failed) == len(records):
        return f"{what} (no files: they could not be written to {where}: {failed[min(failed)]})"
    files = f"files in {where}: python -m fastdist hang-report {where}"
    if failed:
        ranks = sorted(failed)
        files += f"; ranks {ranks} could not write theirs: {failed[ranks[0]]}"
    return f"{what} ({files})"


def _excepthook(
    kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None
) -> None:
    if getattr(exc, "fastdist_reported", False):
        return  # already logged with its rank, position and traceback
    _previous_excepthook(kind, exc, tb)


_previous_excepthook = sys.excepthook


def install_excepthook() -> None:
    """Keep Python from printing a traceback fastdist already reported (idempotent)."""
    if sys.excepthook is not _excepthook:
        global _previous_excepthook
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
