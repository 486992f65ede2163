"""Record a run as JSON Lines (one JSON object per line), from rank 0, with no dependencies."""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any

from fastdist.callbacks.callback import Callback

DEFAULT_FILE_NAME = "log.jsonl"


class JSONLogCallback(Callback):
    """Append every logged value of a run to a JSON Lines file; ``fastdist plot`` draws it.

    Put it in ``callbacks_master`` (in ``callbacks_all`` it still writes on rank 0 only). The
    file is opened in append mode when training begins, so several runs may share one file,
    each starting with its ``"start"`` record. Every line is flushed when it is written, and
    the file is closed when training ends or raises. One record is written:

    * ``kind="start"`` when training begins: ``start_time`` (local ISO 8601), ``world_size``,
      ``total_steps``, ``global_batch`` and ``config`` (every :class:`DistTrainer` option);
    * ``kind="train"`` every ``print_every`` updates, when the trainer logs the training
      loss: ``step`` (``global_step``), ``epoch``, ``loss`` (mean over all ranks since the
      previous one), ``lr`` (first parameter group), ``time``
      (seconds since training began), ``samples_per_s``: the nominal global batch
      (``batch_size_per_gpu * world_size * update_every``) times the updates since the
      previous ``"train"`` record, over the seconds since then spent outside evaluation, and
      ``ranks``: one dict per rank of its mean time per update since the previous log step
      (``rank``, ``update_ms``, ``data_ms``, ``compute_ms``, ``collective_ms``; see
      :mod:`fastdist.trainer.timing`);
    * ``kind="eval"`` after every evaluation: ``step``, ``epoch``, ``time``, ``is_better`` and
      every key of the result (``acc``...);
    * ``kind="end"`` when training ends: ``best_eval``, ``best_epoch``, ``best_step``,
      ``steps`` and ``seconds``; or ``kind="exception"`` (``error``) when it raises.

    A non-finite loss is written as ``NaN``/``Infinity``, which Python's ``json`` reads back.

    Args:
        path: the file to append to. Default: ``log.jsonl`` in the trainer's ``save_path`` if
            it has one, else ``log.jsonl`` in the current directory. Missing directories are
            created.

    Example:
        >>> DistTrainer(..., save_path="save", callbacks_master=[JSONLogCallback()])
        >>> # save/log.jsonl; then: python -m fastdist plot save -o curves.png
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path: str | None = None if path is None else os.fspath(path)
        self.file: IO[str] | None = None
        self._start = 0.0
        self._last_time = 0.0
        self._last_step = 0
        self._eval_seconds = 0.0
        self._valid_start: float | None = None

    def resolve_path(self) -> str:
        """The file this callback writes: ``path``, or the default described above."""
        if self.path is not None:
            return self.path
        save_path = self.trainer.options.save_path
        return os.path.join(save_path or os.curdir, DEFAULT_FILE_NAME)

    def on_train_begin(self) -> None:
        trainer = self.trainer
        if trainer.rank != 0:
            return  # in callbacks_all: the other ranks would write duplicates
        path = self.resolve_path()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.close()
        self.file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._start = self._last_time = time.monotonic()
        self._last_step = trainer.state.global_step
        self._eval_seconds = 0.0
        self._valid_start = None
        self._write(
            kind="start",
            step=trainer.state.global_step,
            epoch=trainer.state.epoch,
            time=0.0,
            start_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            world_size=trainer.world_size,
            total_steps=trainer.state.total_steps,
            global_batch=trainer.global_batch,
            config=trainer.options.as_dict(),
        )

    def on_step_end(self) -> None:
        state = self.trainer.state
        if state.global_step % self.trainer.options.print_every == 0 and state.loss is not None:
            self._write_train_record()  # the trainer refreshed state.loss just before

    def on_valid_begin(self) -> None:
        self._valid_start = time.monotonic()

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        if self._valid_start is not None:
            self._eval_seconds += time.monotonic() - self._valid_start
            self._valid_start = None
        state = self.trainer.state
        record: dict[str, Any] = {
            "kind": "eval",
            "step": state.global_step,
            "epoch": state.epoch,
            "time": self._elapsed(),
            "is_better": is_better,
        }
        for key, value in eval_result.items():
            record[f"metric_{key}" if key in record else key] = value
        self._write(**record)

    def on_train_end(self) -> None:
        state = self.trainer.state
        self._write(
            kind="end",
            step=state.global_step,
            epoch=state.epoch,
            time=self._elapsed(),
            best_eval=state.best_eval,
            best_epoch=state.best_epoch,
            best_step=state.best_step,
            steps=state.global_step,
            seconds=self._elapsed(),
        )
        self.close()

    def on_exception(self, exception: BaseException) -> None:
        if self.file is not None:
            state = self.trainer.state
            self._write(
                kind="exception",
                step=state.global_step,
                epoch=state.epoch,
                time=self._elapsed(),
                error=f"{type(exception).__name__}: {exception}",
            )
        self.close()

    def close(self) -> None:
        """Close the file if it is open (done at train end and on an exception)."""
        if self.file is not None:
            self.file.close()
            self.file = None

    def _write_train_record(self) -> None:
        state = self.trainer.state
        now = time.monotonic()
        seconds = now - self._last_time - self._eval_seconds
        steps = state.global_step - self._last_step
        samples = self.trainer.global_batch * steps
        self._last_time, self._last_step, self._eval_seconds = now, state.global_step, 0.0
        self._write(
            kind="train",
            step=state.global_step,
            epoch=state.epoch,
            loss=state.loss,
            lr=float(self.trainer.optimizer.param_groups[0]["lr"]),
            time=now - self._start,
            samples_per_s=samples / seconds if seconds > 0 else None,
            ranks=state.rank_times,
        )

    def _elapsed(self) -> float:
        return time.monotonic() - self._start

    def _write(self, **record: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, default=str) + "\n")
            self.file.flush()
