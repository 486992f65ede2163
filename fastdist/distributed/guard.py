"""Refuse collectives inside rank-0-only code, where they would hang the other ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

# Every torch.distributed function that waits for other ranks.
_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


class CollectiveInMasterCallbackError(RuntimeError):
    """A ``callbacks_master`` callback called a collective that the other ranks never join."""


@contextlib.contextmanager
def no_collectives(where: str) -> Iterator[None]:
    """Make every ``torch.distributed`` collective raise while the block runs.

    Used around ``callbacks_master`` hooks: a collective there runs on rank 0 only and would
    wait forever for ranks that are not running the callback.
    """

    def refuse(name: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> None:
            raise CollectiveInMasterCallbackError(
                f"{where} called torch.distributed.{name}() on rank 0 only: callbacks_master "
                "run on rank 0 alone, so the other ranks would never join. Move this callback "
                "to callbacks_all so every rank takes part, or keep its rank-0 work free of "
                "collectives (e.g. a @rank_zero_only function called from callbacks_all)."
            )

        return refused

    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name in originals:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
