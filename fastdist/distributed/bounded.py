"""Calls that may not return, given a bound: store calls on a failure or exit path, where the
store's host may be cut off from this rank."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
#: Seconds a failing or exiting rank waits for the rendezvous store: its host may be cut off
#: from this rank (a network cut), where a store call would wait forever (TCPStore's
#: ``check`` and ``add`` wait for the reply without a bound, whatever ``set_timeout`` says).
STORE_WAIT_S = 5.0

#: Why the store stopped answering, once a call timed out (``None``: it answers).
_unanswered: str | None = None


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``, or ``TimeoutError`` after ``seconds`` (the call is left running in a daemon
    thread). For store calls on a failure path, where the store's host may not answer.

    Once a call timed out, later ones raise at once (until :func:`forget`): a failure report
    and the exit make several store calls, and a host cut off is not waited for each time."""
    global _unanswered
    if _unanswered is not None:
        raise TimeoutError(f"{_unanswered} (not asked again)")
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="fastdist-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if error:
        raise error[0]
    if not result:
        _unanswered = f"the rendezvous store did not answer within {seconds:g} s"
        raise TimeoutError(_unanswered)
    return result[0]


def forget() -> None:
    """A new group's store: ask it again (see :func:`within`)."""
    global _unanswered
    _unanswered = None
