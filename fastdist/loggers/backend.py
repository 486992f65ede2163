"""``Logger``, the base of every backend: it only writes what :class:`~fastdist.loggers.RunLog`
hands it, under the names and steps of ``log.jsonl``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastdist.checks import check_list

Scalar = bool | int | float | str

#: The fields of a ``log.jsonl`` record that are not values to plot.
RECORD_FIELDS = ("kind", "step", "epoch", "time", "is_better")
#: The parts of a rank's time per update (``ranks`` of a ``"train"`` record).
TIME_PARTS = ("update_ms", "data_ms", "compute_ms", "collective_ms")


@dataclass(frozen=True)
class RunContext:
    """What a backend learns when training begins.

    Attributes:
        save_path: the trainer's ``save_path`` (file-based backends write under it by default).
        step: the optimizer update training starts from (> 0 on a resume).
        rollback: the run resumed from a checkpoint older than the newest one (a rollback in
            place, see :meth:`~fastdist.DistTrainer.train`), or on another number of
            processes than the checkpoint's: what a backend holds of the run beyond ``step``
            belongs to a discarded branch, unlike a plain resume, which trains the steps after
            ``step`` again exactly as before (:attr:`~fastdist.state.TrainerState.rolled_back`).
    """

    save_path: str | None
    step: int
    rollback: bool = False

    def under_save_path(self, name: str, fallback: str) -> str:
        """``save_path/name``, or ``fallback`` (relative to the current directory) without one."""
        return os.path.join(self.save_path, name) if self.save_path else fallback


class Logger:
    """A logging backend: override :meth:`open`, :meth:`log_options`, :meth:`log_scalars`,
    :meth:`close` (and :meth:`state_dict` to continue the same run on a resume).

    It runs on rank 0 only, from ``callbacks_master``: it must not call collectives. An
    exception it raises is reported once as a warning, after which it is closed
    (``close(failed=True)``, whose own exception is ignored) and writes nothing more;
    training goes on (one raised by :meth:`load_state_dict` starts it afresh instead). A
    constructor checks its arguments at once, alike on every rank, and raises
    ``TypeError``/``ValueError`` naming the argument and the fix.
    """

    #: At most one backend of this class per trainer (e.g. wandb keeps one run per process).
    one_per_process = False

    def destination(self, run: RunContext) -> str | None:
        """The file or directory this backend writes that no other backend of the run may
        share (an absolute path; ``run.step`` is 0), or ``None``."""
        return None

    def open(self, run: RunContext) -> None:
        """Start writing (training begins; after :meth:`load_state_dict` on a resume)."""

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one ``log.jsonl`` record: its options (``"start"``) or its scalars."""
        if record["kind"] == "start":
            self.log_options(options(record))
        elif record["kind"] in ("train", "eval"):
            self.log_scalars(scalars(record), record["step"])

    def log_options(self, options: dict[str, Scalar]) -> None:
        """Record the run's options, once, when training begins."""

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        """Record ``values`` (``loss``, ``lr``, ``dev/<key>``...) at optimizer update ``step``."""

    def close(self, failed: bool) -> None:
        """Finish writing: training ended, or raised (``failed``)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps to continue the same run (e.g. its run id); ``{}``: none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result, before :meth:`open` of a resumed run (only
        then: a backend opened without it starts a new run)."""


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a ``"train"`` or ``"eval"`` record under the names every backend uses:
    ``epoch``, ``loss``, ``lr``, ``samples_per_s``, ``memory_mb``,
    ``time/<part>_ms/rank<R>``; ``dev/<key>`` for an evaluation result."""
    if record["kind"] == "eval":
        return {
            f"dev/{key}": float(value)
            for key, value in record.items()
            if key not in RECORD_FIELDS and isinstance(value, (int, float))
        }
    values = {
        key: float(record[key])
        for key in ("epoch", "loss", "lr", "samples_per_s", "memory_mb")
        if isinstance(record.get(key), (int, float))
    }
    for times in record.get("ranks") or ():
        for part in TIME_PARTS:
            values[f"time/{part}/rank{times['rank']}"] = float(times[part])
    return values


def options(record: Mapping[str, Any]) -> dict[str, Scalar]:
    """The run's options of a ``"start"`` record, flat; values that are not scalars (or
    ``None``) become strings."""
    values = {
        "world_size": record["world_size"],
        "global_batch": record["global_batch"],
        "total_steps": record["total_steps"],
        "optimizer": record["optimizer"],
        "lr": record["lr"],
        **record["config"],
    }
    return {
        key: value if isinstance(value, (bool, int, float, str)) else str(value)
        for key, value in values.items()
    }


def check_loggers(
    value: object, save_path: str | None, others: Sequence[tuple[str, Logger]] = ()
) -> list[Logger]:
    """``DistTrainer(loggers=...)``: a list of :class:`Logger` backends, each object once, no
    two writing the same file or directory (``others``: backends the callbacks hold, each
    with the words for where it is, e.g. ``"a JSONLogCallback in callbacks_master"``)."""
    loggers = check_list("loggers", value, Logger, "fastdist.loggers backends", "JsonLogger()")
    if len({id(b) for b in loggers}) < len(loggers):
        raise ValueError("loggers holds the same backend object twice: pass each backend once")
    every = [(f"a {type(b).__name__} in loggers", b) for b in loggers]
    every += [(f"the {type(b).__name__} of {where}", b) for where, b in others]
    run, writers = RunContext(save_path, 0), dict[Any, tuple[str, str]]()
    for words, backend in every:
        kind = type(backend)
        if kind.one_per_process and sum(type(b) is kind for _, b in every) > 1:
            raise ValueError(
                f"loggers holds two {kind.__name__}s: it keeps one run per process (a second "
                "one would write into the first's run): keep one"
            )
        where = backend.destination(run)
        if where is None:
            continue
        first, path = writers.setdefault(file_identity(where), (words, where))
        if first is not words:
            raise ValueError(
                f"{first} ({path!r}) and {words} ({where!r}) both write one file or directory "
                f"{os.path.realpath(where)!r} (every record would be written twice, "
                "interleaved): keep one of them, or give each its own path"
            )
    return loggers


def file_identity(path: str) -> Any:
    """What tells whether two paths are one file or directory: its device and inode where it
    exists (a hard link too), else the path with symbolic links resolved."""
    try:
        found = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return found.st_dev, found.st_ino
