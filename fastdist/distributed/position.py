"""Where every rank is, so a failed or timed-out collective can say who is where.

Each rank keeps its position locally (cheap attribute updates) and publishes it to the
rendezvous store when it moves between phases (epoch start, evaluation, a sync point), and
after an update at most once a second (:meth:`PositionBoard.update`), never per micro-batch:
a rank that dies is reported where it was at most a second before. When something fails,
every surviving rank publishes its final position and reads the others' last published ones to
write one readable report.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch.distributed as dist

_KEY = "fastdist/position/{}"
#: Seconds between publications of a rank's position after its updates.
UPDATE_EVERY_S = 1.0


def _default_store() -> Any:
    # The default group's store is the rendezvous store torchrun set up; torch exposes it only
    # through this private accessor.
    return dist.distributed_c10d._get_default_store()


class PositionBoard:
    """This rank's position, and the last published position of every rank."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.store = _default_store() if world_size > 1 and dist.is_initialized() else None
        self.fields: dict[str, Any] = {}
        self._published = -math.inf  # when this rank last published (monotonic)

    def move(self, **fields: Any) -> None:
        """Update this rank's position locally (no communication)."""
        self.fields.update(fields)

    def update(self, **fields: Any) -> None:
        """Update this rank's position; publish it if the last publication is a second old."""
        self.fields.update(fields)
        if self.store is not None and time.monotonic() - self._published >= UPDATE_EVERY_S:
            self.publish()

    def publish(self, **fields: Any) -> None:
        """Update this rank's position and write it to the store for the other ranks."""
        self.fields.update(fields)
        if self.store is not None:
            record = dict(self.fields, time=time.time())
            self.store.set(_KEY.format(self.rank), json.dumps(record))
            self._published = time.monotonic()

    def describe(self, fields: dict[str, Any]) -> str:
        """``epoch 1, step 3, phase train, in Printer.on_step_end`` from a position record."""
        parts = [f"{k} {fields[k]}" for k in ("epoch", "step", "phase") if k in fields]
        if fields.get("hook"):
            parts.append(f"in {fields['hook']}")
        if fields.get("failed"):
            parts.append(f"FAILED with {fields['failed']}")
        return ", ".join(parts) or "not started"

    def report(self) -> str:
        """One block: this rank's position, the others' last known ones, the ranks missing."""
        own = {k: v for k, v in self.fields.items() if k != "failed"}  # the headline says it
        lines = [f"  rank {self.rank} (this rank): {self.describe(own)}"]
        missing = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            other = self._read(rank)
            if other is None:
                lines.append(f"  rank {rank}: no position published")
                missing.append(rank)
                continue
            age = time.time() - other.pop("time", time.time())
            lines.append(f"  rank {rank}: {self.describe(other)} (published {age:.0f} s ago)")
            if any(other.get(k) != self.fields.get(k) for k in ("epoch", "step", "phase")):
                missing.append(rank)
        if missing:
            lines.append(f"  ranks not at this rank's position: {missing}")
        return "\n".join(lines)

    def _read(self, rank: int) -> dict[str, Any] | None:
        if self.store is None:
            return None
        key = _KEY.format(rank)
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception:  # the store's host may be gone too; report what we know
            return None
