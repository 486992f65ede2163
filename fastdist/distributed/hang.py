"""Each rank's Python line and last collectives at the moment a collective fails.

A daemon thread on every rank (:func:`watch`) waits, on a connection of its own to the
rendezvous store, for a request. A rank whose collective times out or loses a peer makes one
(:func:`collect`); every rank then answers with a record: its main thread's Python stack (where
it is, in a collective or in user code), the last collective it entered in each process group
(torch's flight recorder, ``TORCH_FR_BUFFER_SIZE``) and its position. A rank that failed answers
with the stack of its failure. The records come back through the store, for the failing rank's
report (:mod:`fastdist.distributed.hang_report`), and each rank writes its own under the dump
directory, for ``python -m fastdist hang-report DIR``:

- ``rank<r>.json``: the record;
- ``rank<r>.stack.txt``: the stack of the record and faulthandler's dump of every thread;
- ``rank<r>.fr.json``: the flight recorder's buffer (its last ``TORCH_FR_BUFFER_SIZE`` entries).

Each record names its job (``job``: an id rank 0 draws at the start of an attempt and every rank
of it reads from the store), so that the report tells this job's records from those an earlier
job left in the same directory.

A process writes its files once, at its first record (the one that shows the hang), with the
record's own flight-recorder dump; its record says why they could not be written
(``dump_error``), so that the report does not name files that are not there.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import functools
import json
import os
import pickle
import sys
import threading
import time
import traceback
import types
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fastdist.distributed.bounded import STORE_WAIT_S, within

#: Flight recorder entries each rank keeps (``TORCH_FR_BUFFER_SIZE``, unless set already).
FR_ENTRIES = 200
#: How long the failing rank waits for the others' records.
ANSWER_WAIT_S = 5.0
#: How long it waits for a rank that answered an earlier request (its earlier record stands in).
KNOWN_WAIT_S = 0.5
#: How long it waits once a SIGTERM came (torchrun's: a rank is gone; the live ones answer at
#: once, from their watcher's thread).
STOPPING_WAIT_S = 1.5
#: The directory for the dumps when ``save_path`` does not give one (the tool's variable).
DIR_VAR = "FASTDIST_HANG_DIR"

_COUNT, _ANSWER, _JOB = "fastdist/hang/count", "fastdist/hang/{}/{}", "fastdist/hang/job"
_REQUEST = "fastdist/hang/request/{}/{}"  # a request's number and the rank asked: "" or "stop"
_FAILED = "fastdist/hang/failed/{}"  # a rank's record of its own failure, kept after it exits
#: How long the exit waits for the watcher to stop.
STOP_WAIT_S = 2.0


@functools.cache
def _library() -> tuple[str, ...]:
    """The folders of fastdist, the standard library and installed packages (found on first
    use: ``sysconfig`` costs a millisecond of ``import fastdist``)."""
    import sysconfig

    return tuple(
        str(Path(p).resolve()) + os.sep
        for p in (
            str(Path(__file__).resolve().parents[1]),  # fastdist
            *(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")),
        )
    )


class _Watch:
    """This process's watcher: where to write, and the failure it answers with, if any."""

    def __init__(self, store: Any, rank: int, directory: str | None, position: Any) -> None:
        self.store, self.rank, self.directory, self.position = store, rank, directory, position
        self.world_size = dist.get_world_size()
        self.job: str | None = None  # read by the watcher's thread: no wait for rank 0 here
        if rank == 0:
            store.set(_JOB, f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
        self.failure: dict[str, Any] | None = None  # this rank's record of its own failure
        self.written = False  # the first dump of this process stays: it shows the hang
        self.dump_error: str | None = None  # why that dump could not be written
        self.number = 1  # the request it waits for
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        client = self.store.clone()
        with contextlib.suppress(Exception):  # the store gone: the job is over
            self.read_job(client)
        while True:
            key = _REQUEST.format(self.number, self.rank)
            try:  # a day's wait: each timeout prints torch's socket warnings
                client.wait([key], datetime.timedelta(days=1))
                if client.get(key) == b"stop":
                    return  # this process is exiting (see stop())
                self.answer(client, self.number)
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc):
                    return  # the store is gone: the job is over
                continue  # no request today
            except Exception:  # the store went while answering
                return
            self.number += 1

    def read_job(self, client: Any) -> None:
        """The job's id, once rank 0 has set it; without waiting in the store's C++ code (an
        exit could not stop that), and no longer once a request or the stop came."""
        asked = _REQUEST.format(self.number, self.rank)
        while not client.check([_JOB]):
            if client.check([asked]):
                return
            time.sleep(0.05)
        self.job = client.get(_JOB).decode()

    def record(
        self, stack: traceback.StackSummary, recorded: dict[str, Any], error: str | None = None
    ) -> dict[str, Any]:
        """This rank's record: its stack (outermost frame first), collectives (from the flight
        recorder's dump ``recorded``), position."""
        return {
            "rank": self.rank,
            "job": self.job,
            "world_size": self.world_size,
            "time": time.time(),
            "error": error,
            "position": self.position(),
            "stack": [[f.filename, f.lineno, f.name] for f in stack],
            "yours": [not is_library(f.filename) for f in stack],  # by this rank's paths
            "collectives": last_collectives(recorded),
        }

    def answer(self, store: Any, number: int) -> None:
        """Answer request ``number``: with this rank's failure, else a record taken now (its
        files written first, from the same flight-recorder dump); with ``dump_error``."""
        record = self.failure
        if record is None:
            recorded = _flight_recorder()
            record = self.record(_main_stack(), recorded)
            self.write(record, recorded)
        answer = dict(record, dump_error=self.dump_error)
        store.set(_ANSWER.format(number, self.rank), json.dumps(answer))

    def renew(self, directory: str | None, position: Any) -> None:
        """For a new run in this process: its directory and position; its first failure is
        written anew, and the run before's failure no longer stands in for this rank."""
        self.directory, self.position = directory, position
        self.failure, self.written, self.dump_error = None, False, None
        with contextlib.suppress(Exception):  # the store's host may be out of reach
            within(STORE_WAIT_S, lambda: self.store.delete_key(_FAILED.format(self.rank)))

    def write(self, record: dict[str, Any], recorded: dict[str, Any]) -> None:
        """Write this rank's files (``recorded``: the flight recorder's dump), unless this
        process wrote them already; note why they could not be written."""
        if self.directory is not None and not self.written:
            self.written = True
            self.dump_error = _write_files(Path(self.directory), record, recorded)


_watch: _Watch | None = None


def enable_flight_recorder() -> None:
    """Have torch record the last collectives of the groups formed from now on (a ring of
    :data:`FR_ENTRIES`), unless ``TORCH_FR_BUFFER_SIZE`` is set (``0`` turns it off)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_ENTRIES))


def dump_dir(save_path: str | None) -> str | None:
    """Where the dumps go: ``$FASTDIST_HANG_DIR``, else ``<save_path>/hang``, else nowhere
    (the failing rank's log still holds the report)."""
    if os.environ.get(DIR_VAR):
        return os.environ[DIR_VAR]
    return None if save_path is None else os.path.join(save_path, "hang")


def watch(rank: int, directory: str | None, position: Any) -> None:
    """Answer requests for this rank's record (from now on; once per process, later calls,
    a new run's, change the directory and the position, a callable returning a description,
    and forget the failure of the run before)."""
    global _watch
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if _watch is not None:
        _watch.renew(directory, position)
        return
    store = dist.distributed_c10d._get_default_store()
    _watch = _Watch(store, rank, directory, position)
    _watch.thread = threading.Thread(target=_watch.run, name="fastdist-hang-watch", daemon=True)
    _watch.thread.start()
    atexit.register(stop)


def stop() -> None:
    """Stop the watcher (at exit): a thread still waiting inside the store's C++ code when
    the interpreter ends aborts the process ("terminate called", exit 134)."""
    watch = _watch
    if watch is None or watch.thread is None:
        return
    key = _REQUEST.format(watch.number, watch.rank)
    with contextlib.suppress(Exception):  # the store's host may be gone: the wait ended too
        within(STOP_WAIT_S, lambda: watch.store.set(key, "stop"))
    watch.thread.join(STOP_WAIT_S)


def dump_dir_in_use() -> str | None:
    """The directory this process writes its dumps to (``None``: none)."""
    return None if _watch is None else _watch.directory


def note_failure(exc: BaseException) -> None:
    """Keep this rank's record of its failure (the stack where ``exc`` was raised): it answers
    requests with it, and it is written to the dump directory at once."""
    if _watch is None:
        return
    tb = exc.__traceback__
    stack = traceback.StackSummary()
    if tb is not None:  # the callers of the frame that caught it, then the traceback
        stack = traceback.extract_stack(tb.tb_frame.f_back)
        stack.extend(traceback.extract_tb(tb))
    recorded = _flight_recorder()
    watch = _watch
    watch.failure = watch.record(stack, recorded, f"{type(exc).__name__}: {exc}"[:300])
    watch.write(watch.failure, recorded)
    answer = json.dumps(dict(watch.failure, dump_error=watch.dump_error))
    with contextlib.suppress(Exception):  # the store's host may be out of reach
        within(STORE_WAIT_S, lambda: watch.store.set(_FAILED.format(watch.rank), answer))


def collect(
    world_size: int, stopping: Callable[[], bool] = lambda: False
) -> dict[int, dict[str, Any]]:
    """Ask every rank for its record; return those that came (by rank). A rank that answered
    an earlier request (its own failure, say) is given :data:`KNOWN_WAIT_S` before its
    earlier record stands in; the others :data:`ANSWER_WAIT_S`, or :data:`STOPPING_WAIT_S`
    once ``stopping()`` is true (a SIGTERM came). Empty without a watcher."""
    if _watch is None:
        return {}
    store = _watch.store
    number = store.add(_COUNT, 1)
    for rank in range(world_size):
        store.set(_REQUEST.format(number, rank), "")
    earlier = {r: _earlier_answer(store, number, r) for r in range(world_size)}
    records: dict[int, dict[str, Any]] = {}
    start = time.monotonic()
    while len(records) < world_size:
        waited = time.monotonic() - start
        for rank in set(range(world_size)) - set(records):
            key = _ANSWER.format(number, rank)
            if store.check([key]):
                records[rank] = json.loads(store.get(key))
            elif earlier[rank] is not None and waited > KNOWN_WAIT_S:
                records[rank] = json.loads(store.get(earlier[rank]))
        if waited > ANSWER_WAIT_S or (waited > STOPPING_WAIT_S and stopping()):
            break
        time.sleep(0.05)
    return records


def _earlier_answer(store: Any, number: int, rank: int) -> str | None:
    """The key of ``rank``'s answer to the newest request before ``number``, else of its record
    of its own failure (kept in the store: the rank may have exited since), if any."""
    keys = [_ANSWER.format(n, rank) for n in range(number - 1, 0, -1)] + [_FAILED.format(rank)]
    return next((key for key in keys if store.check([key])), None)


def last_collectives(recorded: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The last collective this rank entered in each process group, from the flight
    recorder's dump ``recorded``: ``{"<id> (<name>)": {"seq": n, "name": "gloo:all_reduce",
    "called_at": ...}}``."""
    last: dict[str, dict[str, Any]] = {}
    for entry in recorded.get("entries", []):
        if entry.get("is_p2p"):
            continue
        number, name = entry["process_group"]
        last[number if name in ("", "undefined") else f"{number} ({name})"] = {
            "seq": entry["collective_seq_id"],
            "name": entry["profiling_name"],
            "called_at": _caller(entry.get("frames") or []),
        }
    return last


def is_library(filename: str) -> bool:
    """Whether ``filename`` is fastdist's, Python's or an installed package's, not the user's."""
    return filename.startswith("<") or str(Path(filename).resolve()).startswith(_library())


def _flight_recorder() -> dict[str, Any]:
    """The flight recorder's buffer as torch dumps it for its analyzer, with each entry's
    Python stack (``frames``: its JSON dump leaves them out); ``{}`` when it is off."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]

        return dict(pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=True)))
    except Exception:  # no recorder in this torch build, or it is off
        return {}


def _caller(frames: list[dict[str, Any]]) -> str | None:
    """``file:line in function`` of the innermost frame outside torch (frames innermost first);
    ``None`` where torch's C++ called it (DDP's gradient buckets)."""
    for frame in frames:
        if "/torch/" not in frame["filename"]:
            return f"{frame['filename']}:{frame['line']} in {frame['name']}"
    return None


def _main_stack() -> traceback.StackSummary:
    frame: types.FrameType | None = sys._current_frames().get(threading.main_thread().ident or 0)
    return traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()


def _write_files(directory: Path, record: dict[str, Any], recorded: dict[str, Any]) -> str | None:
    """This rank's three files under ``directory`` (``recorded``: the flight recorder's dump);
    ``None``, or why they could not be written (a failure to write is not the job's)."""
    rank = record["rank"]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
        with open(directory / f"rank{rank}.stack.txt", "w") as out:
            what = "its failure" if record["error"] else "the request"
            out.write(f"rank {rank}, main thread at {what}:\n")
            frames = [(f, line, name, None) for f, line, name in record["stack"]]
            out.writelines(traceback.StackSummary.from_list(frames).format())
            out.write("\nevery thread now (faulthandler):\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        if recorded:
            (directory / f"rank{rank}.fr.json").write_text(json.dumps(recorded, default=str))
    except Exception as exc:  # noqa: BLE001 - a dump must never hide the failure it reports
        why = f"{type(exc).__name__}: {exc}"
        print(f"fastdist: could not write the hang dump to {directory}: {why}", file=sys.stderr)
        return why
    return None
