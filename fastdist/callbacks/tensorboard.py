"""Record a run for TensorBoard (``torch.utils.tensorboard``), from rank 0."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastdist.callbacks.callback import Callback

MISSING_TENSORBOARD = (
    "TensorBoardCallback needs tensorboard, which is not installed: "
    'pip install tensorboard (or pip install "fastdist[tensorboard]")'
)


class TensorBoardCallback(Callback):
    """Write the training loss, learning rate, evaluation results and hyper-parameters.

    Put it in ``callbacks_master`` (in ``callbacks_all`` it still writes on rank 0 only).
    tensorboard is imported only when training starts (``pip install fastdist[tensorboard]``).
    The event files go to ``log_dir``; view them with ``tensorboard --logdir LOG_DIR``.
    Written, all against ``global_step`` (optimizer updates):

    * ``train/loss`` (mean over all ranks since the previous point) and ``train/lr`` (one
      per parameter group: ``train/lr``, ``train/lr_1``, ...) every ``print_every`` updates,
      when the trainer reduces the loss, and with them every rank's time per update since
      the previous point, ``time/<part>_ms/rank<R>`` for ``update``, ``data``, ``compute`` and
      ``collective`` (see :mod:`fastdist.trainer.timing`);
    * ``dev/<key>`` for every key of every evaluation result, and ``best/<key>`` whenever
      the result is the best so far;
    * the hyper-parameters (world size, global batch, every trainer option, the optimizer,
      ``hparams``) as a text table ``hparams`` when training begins, and, when it ends, as
      TensorBoard's HPARAMS entry with the best result (``hparam/best_<key>``) and the
      last training loss (``hparam/final_loss``).

    The writer is flushed after every evaluation and closed when training ends or raises.
    A resumed run writes to the same directory and drops the events after its resume step.

    Args:
        log_dir: directory of the event files (created if missing).
        hparams: more hyper-parameters to record (e.g. the script's arguments).
        flush_secs: how often the writer flushes on its own, in seconds.

    Example:
        >>> DistTrainer(..., callbacks_master=[TensorBoardCallback(log_dir="runs/exp1")])
        >>> # then: tensorboard --logdir runs
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] = "runs",
        hparams: Mapping[str, Any] | None = None,
        flush_secs: int = 30,
    ) -> None:
        self.log_dir = os.fspath(log_dir)
        self.extra_hparams = dict(hparams or {})
        self.flush_secs = flush_secs
        self.writer: Any = None

    def on_train_begin(self) -> None:
        trainer = self.trainer
        if trainer.rank != 0:
            return  # in callbacks_all: the other ranks would write duplicates
        try:  # optional dependency, imported only when used
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"{MISSING_TENSORBOARD} ({exc})") from exc
        self.close()
        step = trainer.state.global_step
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = SummaryWriter(
            log_dir=self.log_dir,
            purge_step=step if step > 0 else None,  # a resume overwrites what came after
            flush_secs=self.flush_secs,
        )
        rows = "\n".join(f"| {k} | {v} |" for k, v in self.hparams().items())
        self.writer.add_text("hparams", f"| name | value |\n|---|---|\n{rows}", step)

    def hparams(self) -> dict[str, bool | int | float | str]:
        """The recorded hyper-parameters; values that are not scalars become strings."""
        trainer = self.trainer
        optimizer = trainer.optimizer
        values: dict[str, Any] = {
            "world_size": trainer.world_size,
            "global_batch": trainer.global_batch,
            **trainer.options.as_dict(),
            "optimizer": type(optimizer).__name__,
            "lr": optimizer.param_groups[0]["lr"],
            **self.extra_hparams,
        }
        return {
            key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in values.items()
        }

    def on_step_end(self) -> None:
        if self.writer is None:
            return
        trainer = self.trainer
        state = trainer.state
        if state.global_step % trainer.options.print_every or state.loss is None:
            return  # the trainer refreshes state.loss every print_every updates
        self.writer.add_scalar("train/loss", state.loss, state.global_step)
        for i, group in enumerate(trainer.optimizer.param_groups):
            tag = "train/lr" if i == 0 else f"train/lr_{i}"
            self.writer.add_scalar(tag, float(group["lr"]), state.global_step)
        for times in state.rank_times or ():
            rank = times["rank"]
            for part in ("update", "data", "compute", "collective"):
                tag = f"time/{part}_ms/rank{rank}"
                self.writer.add_scalar(tag, times[f"{part}_ms"], state.global_step)

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        if self.writer is None:
            return
        step = self.trainer.state.global_step
        for key, value in eval_result.items():
            self.writer.add_scalar(f"dev/{key}", value, step)
            if is_better:
                self.writer.add_scalar(f"best/{key}", value, step)
        self.writer.flush()

    def on_train_end(self) -> None:
        if self.writer is None:
            return
        state = self.trainer.state
        metrics = {f"hparam/best_{k}": v for k, v in (state.best_eval or {}).items()}
        if state.loss is not None:
            metrics["hparam/final_loss"] = state.loss
        if metrics:
            # run_name=".": the HPARAMS entry lives in log_dir itself, beside the curves.
            self.writer.add_hparams(
                self.hparams(), metrics, run_name=os.curdir, global_step=state.global_step
            )
        self.close()

    def on_exception(self, exception: BaseException) -> None:
        self.close()  # what was written so far reaches the disk

    def close(self) -> None:
        """Flush and close the writer if it is open (done at train end and on an exception)."""
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
