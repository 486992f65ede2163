"""Where every rank is, so a failed or timed-out collective can say who is where.

Each rank keeps its position locally (cheap attribute updates) and publishes it to the
rendezvous store when it moves between phases (epoch start, evaluation, a sync point), and
after an update at most once a second (:meth:`PositionBoard.update`), never per micro-batch:
a rank that dies is reported where it was at most a second before. When something fails,
every surviving rank publishes its final position and reads the others' last published ones to
write one readable report.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import time
from typing import Any

import torch.distributed as dist

from fastdist.distributed.bounded import STORE_WAIT_S, within
from fastdist.distributed.env import EXITED_COUNT, EXITING, get_rank, get_world_size
from fastdist.distributed.guard import refuse_if_guarded

_KEY = "fastdist/position/{}"
_ENTERED = "fastdist/entered/{}/{}"  # a call's name and its number on each rank; one count
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

    def publish_failure(self, summary: str) -> None:
        """Publish that this rank failed with ``summary``, within :data:`STORE_WAIT_S` (the
        store's host may be out of reach: then only this rank's report says it)."""
        try:
            within(STORE_WAIT_S, lambda: self.publish(failed=summary))
        except Exception:
            self.fields.update(failed=summary)

    def describe(self, fields: dict[str, Any]) -> str:
        """``epoch 1, step 3, phase train, in Printer.on_step_end`` from a position record."""
        parts = [f"{k} {fields[k]}" for k in ("epoch", "step", "phase") if k in fields]
        if fields.get("hook"):
            parts.append(f"in {fields['hook']}")
        if fields.get("failed"):
            parts.append(f"FAILED with {fields['failed']}")
        return ", ".join(parts) or "not started"

    def report(self) -> str:
        """One block: this rank's position, the others' last known ones, the ranks missing;
        each with the time it was taken.

        Every store read is bounded by :data:`STORE_WAIT_S`: a rank cut off from the store's
        host names the others as unreachable instead of waiting.
        """
        own = {k: v for k, v in self.fields.items() if k != "failed"}  # the headline says it
        lines = [f"  rank {self.rank} (this rank): {self.describe(own)} (at {clock(time.time())})"]
        records, unreachable = self._gather(0.0)
        missing = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            other = records.get(rank)
            if unreachable:
                lines.append(
                    f"  rank {rank}: unreachable (the store did not answer: {unreachable})"
                )
                missing.append(rank)
            elif other is None:
                lines.append(f"  rank {rank}: no position published")
                missing.append(rank)
            else:
                published = other.pop("time", time.time())
                age = f"published {time.time() - published:.0f} s ago, at {clock(published)}"
                lines.append(f"  rank {rank}: {self.describe(other)} ({age})")
                if any(other.get(k) != self.fields.get(k) for k in ("epoch", "step", "phase")):
                    missing.append(rank)
        if missing:
            lines.append(f"  ranks not at this rank's position: {missing}")
        return "\n".join(lines)

    def silent_ranks(self, wait: float) -> list[int]:
        """The ranks that have not published a failure after ``wait`` s (none where the store
        does not answer): after a collective failed, those dead, stuck or cut off, which the
        positions do not tell where every rank was in the same collective."""
        records, unreachable = self._gather(wait)
        return [
            r
            for r, record in records.items()
            if not unreachable and not (record or {}).get("failed")
        ]

    def _gather(self, wait: float) -> tuple[dict[int, dict[str, Any] | None], str]:
        """The other ranks' last published positions (``None``: none), once every one says
        it failed or after ``wait`` s; and why the store did not answer (``""``: it did)."""
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        deadline = time.monotonic() + wait
        while True:
            try:
                records = {
                    r: within(STORE_WAIT_S, functools.partial(self._fetch, r)) for r in others
                }
            except Exception as exc:  # cut off from the store's host, or it is gone
                return {}, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            failed = all(record and record.get("failed") for record in records.values())
            if failed or time.monotonic() >= deadline:
                return records, ""
            time.sleep(0.2)

    def _read(self, rank: int) -> dict[str, Any] | None:
        try:
            return self._fetch(rank)
        except Exception:  # the store's host may be gone too; report what we know
            return None

    def _fetch(self, rank: int) -> dict[str, Any] | None:
        """``rank``'s last published position (``None``: none); raises where the store fails."""
        if self.store is None:
            return None
        key = _KEY.format(rank)
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))


def clock(seconds: float) -> str:
    """The local time ``seconds`` (since the epoch) as ``14:03:07.2``: when a report's line was
    taken, so that lines taken at different moments are not read as one."""
    return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{int(seconds % 1 * 10)}"


_calls: collections.Counter[str] = collections.Counter()  # this process's calls by name


def enter_on_every_rank(call: str, timeout: float | None) -> None:
    """Wait until every rank has entered ``call`` (a function every rank must call, such as
    ``save_model``) as often as this one, before its first collective.

    The ranks count their entries in the rendezvous store. Where one is not coming, this
    raises instead of a collective that would wait for it: at once if some rank is exiting
    (its script ended), else after ``timeout`` seconds (``None``: the group's timeout, which
    its rendezvous store holds), naming the ranks missing and where they last were.
    """
    world = get_world_size()
    if world == 1 or not dist.is_initialized():
        return
    refuse_if_guarded(f"{call}()")  # in callbacks_master: at once, not after the timeout
    number = _calls[call]
    _calls[call] += 1
    board = PositionBoard(get_rank(), world)  # to read where the others are
    store, key = _default_store(), _ENTERED.format(call, number)
    store.set(f"{key}/{board.rank}", "")
    count = store.add(key, 1)
    limit = timeout if timeout is not None else store.timeout.total_seconds()
    start, pause = time.monotonic(), 0.001
    while count < world:
        if store.add(EXITED_COUNT, 0) or time.monotonic() - start > limit:
            exiting = [r for r in range(world) if store.check([EXITING.format(r)])]
            missing = [r for r in range(world) if not store.check([f"{key}/{r}"])]
            where = "; ".join(f"rank {r}: {board.describe(board._read(r) or {})}" for r in missing)
            why = f"ranks {exiting} ended their script" if exiting else f"{limit:g} s passed"
            raise RuntimeError(
                f"{call} must be called on every rank, but ranks {missing} did not call it "
                f"({why}; {where}): call it on every rank, not under `if rank == 0`"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
        count = store.add(key, 0)
