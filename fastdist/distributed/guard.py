"""Refuse collectives inside rank-0-only code, where they would hang the other ranks.

Patching the functions of ``torch.distributed`` would miss a function imported by name
(``from torch.distributed import barrier``) and one called from inside torch. Instead the
guard closes the two places every entry point goes through in ``distributed_c10d``: the
communication methods of ``ProcessGroup`` (every collective, object collective and
point-to-point call ends in one, e.g. ``barrier()`` in ``group.barrier``, ``all_gather_object``
in ``group.allgather``), and ``_new_process_group_helper``, through which ``new_group``,
``new_subgroups`` and ``init_process_group`` make a group.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed.distributed_c10d as c10d

# The methods of ProcessGroup that talk to other ranks (its bookkeeping ones stay usable).
_METHODS = (
    "_allgather_base",
    "_reduce_scatter_base",
    "all_gather_single",
    "all_gather_single_coalesced",
    "all_to_all_single",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "alltoall_base",
    "barrier",
    "broadcast",
    "gather",
    "merge_remote_group",
    "monitored_barrier",
    "recv",
    "recv_anysource",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "scatter",
    "send",
    "split_group",
)
# (owner, attribute) of every gate, the ones this torch has.
_GATES = [(c10d.ProcessGroup, name) for name in _METHODS if name in vars(c10d.ProcessGroup)] + [
    (c10d, "_new_process_group_helper")
]


#: How :func:`no_collectives`' ``where`` starts for a logging backend's call.
BACKEND = "logging backend "


class CollectiveInMasterCallbackError(RuntimeError):
    """A ``callbacks_master`` callback called a collective that the other ranks never join."""


def _entry_point(gate: str) -> str:
    """The ``torch.distributed`` function the caller entered: the outermost frame of
    ``distributed_c10d`` on the stack (``all_gather_object``, not the ``all_gather`` it uses);
    the gate itself when it was called directly."""
    name, frame = f"ProcessGroup.{gate}", sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == c10d.__file__:
            name = frame.f_code.co_name
        frame = frame.f_back  # type: ignore[assignment]
    return name


def _refuser(owner: Any, gate: str) -> Any:
    """What stands in for the gate ``gate`` while a guarded block runs: it refuses on the
    thread that runs the block; other threads (a background checkpoint writer, on a group of
    its own) call the gate itself."""
    original = vars(owner)[gate]

    def refused(*args: Any, **kwargs: Any) -> Any:
        if not _guarded():
            return original(*args, **kwargs)
        raise _refusal(f"torch.distributed.{_entry_point(gate)}()")

    return refused


def _guarded() -> bool:
    """Whether this thread runs a guarded block."""
    return bool(_thread) and threading.get_ident() == _thread[-1]


def _refusal(function: str) -> CollectiveInMasterCallbackError:
    """The error of a guarded block that called ``function``, a collective."""
    called = f"{_where[-1]} called {function} on rank 0 only"
    if _where[-1].startswith(BACKEND):
        return CollectiveInMasterCallbackError(
            f"{called}: logging backends run on rank 0 alone and must not call "
            "collectives (the other ranks would never join)"
        )
    return CollectiveInMasterCallbackError(
        f"{called}: callbacks_master run on rank 0 alone, so the other ranks would never "
        "join. Move this callback to callbacks_all so every rank takes part, or keep its "
        "rank-0 work free of collectives (e.g. a @rank_zero_only function called from "
        "callbacks_all)."
    )


def refuse_if_guarded(function: str) -> None:
    """Raise what a collective would in a guarded block of this thread: for a call that waits
    for the other ranks in the store before its first collective (``fastdist.barrier()``)."""
    if _guarded():
        raise _refusal(function)


_REFUSERS = {(owner, name): _refuser(owner, name) for owner, name in _GATES}
_where: list[str] = []  # the guarded blocks running, innermost last
_thread: list[int] = []  # the thread running each


@contextlib.contextmanager
def no_collectives(where: str) -> Iterator[None]:
    """Make every ``torch.distributed`` collective that this thread calls raise while the
    block runs (other threads' collectives go through).

    Used around ``callbacks_master`` hooks: a collective there runs on rank 0 only and would
    wait forever for ranks that are not running the callback. The gates are restored when the
    block ends, also when it raises; outside it nothing is patched (8 us per block here).
    """
    originals = [(owner, name, vars(owner)[name]) for owner, name in _GATES]
    _where.append(where)
    _thread.append(threading.get_ident())
    for owner, name, _ in originals:
        setattr(owner, name, _REFUSERS[owner, name])
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        _where.pop()
        _thread.pop()
