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


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``, or ``TimeoutError`` after ``seconds`` (the call is left running in a daemon
    thread). For store calls on a failure path, where the store's host may not answer."""
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
        raise TimeoutError(f"the rendezvous store did not answer within {seconds:g} s")
    return result[0]
