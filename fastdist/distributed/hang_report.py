"""The hang report: per rank, the collective it waits in (or never entered) and its Python line.

Made from the records of :mod:`fastdist.distributed.hang`, the same text in the failing rank's
log and from ``python -m fastdist hang-report DIR`` (:func:`read_records` reads a dump
directory). In each process group the newest collective any rank entered is the one the job
waits in; the ranks whose last collective there is older never entered it: the missing ranks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastdist.distributed.hang import is_library
from fastdist.distributed.position import clock

Record = dict[str, Any]
#: The most ranks a report covers (a record's ``world_size``, a file's rank, ``--world-size``).
MAX_WORLD_SIZE = 100_000
#: Record times later than this (the year 5138) are corrupt.
_MAX_TIME = 1e11


def read_records(
    directory: str | Path,
) -> tuple[dict[int, Record], dict[int, str], dict[int, str]]:
    """The ``rank<r>.json`` records of a dump directory's newest job (that of the newest
    record), by rank; by rank, what is wrong with each file that holds no record (its path and
    why: truncated, corrupt...); and, by rank, the files an earlier job left (path and time)."""
    records, unreadable = {}, {}
    for path in sorted(Path(directory).glob("rank*.json")):
        if not path.stem[4:].isdigit():
            continue
        rank = int(path.stem[4:])
        if rank >= MAX_WORLD_SIZE:
            unreadable[rank] = f"{path}: a rank beyond the most a report covers ({MAX_WORLD_SIZE})"
            continue
        try:
            record = json.loads(path.read_text())
            problem = _problem(record, rank)
        except (OSError, ValueError) as exc:  # ValueError: invalid JSON or UTF-8
            problem = f"not JSON (truncated or corrupt?): {exc}"
        if problem is None:
            records[rank] = record
        else:
            unreadable[rank] = f"{path}: {problem}"
    newest = max(records.values(), key=lambda r: r["time"]).get("job") if records else None
    stale = {
        rank: f"{directory}/rank{rank}.json is an earlier job's ({record.get('job') or 'no id'}, "
        f"at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(record['time']))})"
        for rank, record in records.items()
        if record.get("job") != newest
    }
    return {r: v for r, v in records.items() if r not in stale}, unreadable, stale


def _problem(record: Any, rank: int) -> str | None:
    """What keeps ``record`` (from ``rank<rank>.json``) from being a hang record, or ``None``."""
    if not isinstance(record, dict):
        return f"not a record (a JSON object) but a {type(record).__name__}"
    missing = [key for key in ("rank", "time", "position", "stack") if key not in record]
    if missing:
        return f"a record without {', '.join(missing)}"
    if record["rank"] != rank:
        return f"holds the record of rank {record['rank']!r}"
    frames = record["stack"]
    if not isinstance(frames, list) or not all(
        isinstance(f, list) and len(f) == 3 and isinstance(f[1], int) for f in frames
    ):
        return "its stack is not a list of [file, line, function]"
    yours = record.get("yours", [])
    if not isinstance(yours, list) or not all(isinstance(y, bool) for y in yours):
        return "its yours is not a list of true/false (one per frame)"
    collectives = record.get("collectives", {})
    if not isinstance(collectives, dict) or not all(
        isinstance(c, dict) and isinstance(c.get("seq"), int) and "name" in c
        for c in collectives.values()
    ):
        return 'its collectives are not {group: {"seq": n, "name": ...}}'
    when = record["time"]
    if not isinstance(when, (int, float)) or not 0 <= when <= _MAX_TIME:  # NaN fails too
        return f"its time is not a time (seconds since 1970): {when!r}"
    size = record.get("world_size", 1)
    if not isinstance(size, int) or not 1 <= size <= MAX_WORLD_SIZE:
        return f"its world_size is not a number of ranks (1 to {MAX_WORLD_SIZE}): {size!r}"
    return None


def describe(
    records: dict[int, Record],
    world_size: int | None = None,
    unreadable: dict[int, str] | None = None,
    stale: dict[int, str] | None = None,
) -> str:
    """The report of ``records`` (by rank) of a job of ``world_size`` ranks (default: the
    world size the records name, so that a dead rank that wrote none is named too); the ranks
    of ``unreadable`` (what is wrong with their files) are named with it, and the files of
    ``stale`` (an earlier job's, by rank) are listed as such, never as this job's state."""
    unreadable, stale = unreadable or {}, stale or {}
    known = [r.get("world_size", 0) for r in records.values()]
    # the ranks the files name: no line per absent rank beyond them, nor beyond the maximum
    world_size = min(
        world_size or max(known, default=0) or max(records, default=-1) + 1, MAX_WORLD_SIZE
    )
    waited = _waited(records)
    missing = {
        group: [r for r, record in records.items() if _seq(record, group) < seq]
        for group, (seq, _) in waited.items()
    }
    if any(missing.values()):  # the groups that wait for someone
        waited = {group: waited[group] for group in waited if missing[group]}
    lines = []
    for rank in range(world_size):
        record = records.get(rank)
        if rank in unreadable:
            lines.append(f"  rank {rank}: no record: {unreadable[rank]}")
            continue
        if record is None:
            earlier = f"; {stale[rank]}" if rank in stale else ""
            lines.append(f"  rank {rank}: no record (dead, or not answering){earlier}")
            continue
        state = f"FAILED with {record['error']}" if record.get("error") else record["position"]
        lines.append(f"  rank {rank} (at {clock(record['time'])}): {state}")
        lines.extend(f"    {line}" for line in _collectives(record, waited))
        lines.append(f"    at {_line(record['stack'], record.get('yours'))}")
    for group, (seq, name) in waited.items():
        if missing[group]:
            inside = [r for r in records if r not in missing[group]]
            lines.append(
                f"  missing ranks: {missing[group]} never entered {name} #{seq} of group "
                f"{group} (ranks {inside} entered it)"
            )
    beyond = sorted(rank for rank in unreadable if rank >= world_size)
    lines.extend(f"  rank {rank}: no record: {unreadable[rank]}" for rank in beyond)
    lines.extend(f"  stale: {stale[rank]}" for rank in sorted(stale) if rank >= world_size)
    if not any(r.get("collectives") for r in records.values()):
        lines.append("  no collectives recorded (the flight recorder is off: TORCH_FR_BUFFER_SIZE)")
    return "\n".join(lines)


def _waited(records: dict[int, Record]) -> dict[str, tuple[int, str]]:
    """Per process group, the newest collective (number, name) any rank entered."""
    newest: dict[str, tuple[int, str]] = {}
    for record in records.values():
        for group, last in record.get("collectives", {}).items():
            if last["seq"] > newest.get(group, (-1, ""))[0]:
                newest[group] = (last["seq"], last["name"])
    return newest


def _seq(record: Record, group: str) -> int:
    last = record.get("collectives", {}).get(group)
    return -1 if last is None else int(last["seq"])


def _collectives(record: Record, waited: dict[str, tuple[int, str]]) -> list[str]:
    """Where the rank stands in each group of ``waited``."""
    lines = []
    for group, (seq, name) in waited.items():
        mine = record.get("collectives", {}).get(group)
        if mine is not None and mine["seq"] == seq:
            caller = mine["called_at"]
            called = f", called at {caller}" if caller else ""  # none: from torch's C++ (DDP)
            lines.append(f"in {name} #{seq} of group {group}{called}")
        else:
            last = "none" if mine is None else f"#{mine['seq']}"
            lines.append(f"never entered {name} #{seq} of group {group} (its last there: {last})")
    return lines


def _line(stack: list[list[Any]], yours: list[bool] | None = None) -> str:
    """``file:line in function`` of the innermost frame of the user's code, and of the
    innermost frame if that is elsewhere (stack outermost first). Which frames are the user's:
    ``yours``, as the rank that wrote the record saw it (its paths), else by this process's."""
    if not stack:
        return "no Python stack"
    where = [f"{file}:{line} in {name}" for file, line, name in stack]
    if yours is None or len(yours) != len(stack):  # a record of an older fastdist
        yours = [not is_library(file) for file, _, _ in stack]
    user = [w for w, mine in zip(where, yours, strict=True) if mine]
    if not user:
        return where[-1]
    if user[-1] == where[-1]:
        return f"{user[-1]} (your code)"
    return f"{user[-1]} (your code), innermost {where[-1]}"
