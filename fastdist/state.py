"""The small state object callbacks read instead of the trainer's internals.

It sits below the trainer and the callbacks, the two packages that share it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class OptionsView(Protocol):
    """What callbacks and loggers read of the trainer's options."""

    @property
    def print_every(self) -> int: ...

    @property
    def save_path(self) -> str | None: ...

    def as_dict(self) -> dict[str, Any]: ...


@dataclass
class TrainerState:
    """Where training is. ``global_step`` counts optimizer updates, not micro-batches.

    Attributes:
        epoch: current epoch, from 1.
        global_step: optimizer updates done so far.
        skipped_steps: updates skipped for non-finite gradients (``on_nonfinite="skip"``), or
            not committed by torchft (``DDP(fault_tolerant=True)``).
        batch_idx: index of the current micro-batch within this pass over the epoch, from 0
            (a pass resumed mid-epoch starts at 0 again).
        samples_in_epoch: global samples of the current epoch trained on (all ranks).
        batches_in_epoch: global micro-batches of the current epoch trained on (all ranks;
            a batch sampler resumes from it).
        epoch_complete: whether the current epoch has been trained to its end.
        n_epochs: epochs to train.
        total_steps: optimizer updates the whole run will make; ``None`` for a stream (unknown
            until it ends).
        is_update: whether the current micro-batch ends an update window (its backward
            all-reduces gradients and the optimizer steps after it).
        is_filler: the current micro-batch is a filler: a rank whose shard gave one batch
            fewer repeats its last batch with loss weight 0 to stay in step (it trains
            nothing; sample-counting callbacks skip it).
        loss: mean training loss over all ranks of the updates after the previous log step up
            to ``loss_step``; it arrives one update after its log step (or at once where an
            evaluation, a checkpoint or the epoch's end follows it): see
            :meth:`~fastdist.trainer.loop.Loop.log_step`.
        loss_step: the log step (update) ``loss`` belongs to.
        unread_loss: in a checkpoint, the training loss's sum and count over every rank's
            updates after the last log step (``None`` elsewhere): a resumed run's first
            logged loss covers them too, as the run's would have.
        eval_result: the latest evaluation result, e.g. ``{"acc": 0.93}``.
        best_eval: the best evaluation result so far, with ``best_epoch`` and ``best_step``.
        stop_requested: set by :meth:`DistTrainer.request_stop`; agreed across ranks at the next
            sync point.
        rolled_back: this run resumed from a checkpoint older than the newest one (a rollback
            in place), or on another number of data shards than the checkpoint's (the steps
            after it are not trained again identically): the steps after ``global_step``
            that were trained before belong to a discarded branch (logging backends must not
            keep them as this run's).
        rank_times: every rank's mean time per update since the previous log step (or
            evaluation, checkpoint), one dict per rank: ``rank``, ``update_ms`` (data +
            compute), ``data_ms``, ``compute_ms``, ``collective_ms``; see
            :mod:`fastdist.trainer.timing`.
        lost_samples: samples of the current epoch that no replica group trained: their
            group failed or was healing at their update (``DDP(fault_tolerant=True)``; see
            :mod:`fastdist.strategies.replica_groups`).
    """

    epoch: int = 0
    global_step: int = 0
    skipped_steps: int = 0
    batch_idx: int = 0
    samples_in_epoch: int = 0
    batches_in_epoch: int = 0
    epoch_complete: bool = False
    n_epochs: int = 0
    total_steps: int | None = 0
    is_update: bool = False
    is_filler: bool = False
    loss: float | None = None
    loss_step: int | None = None
    unread_loss: list[float] | None = None
    eval_result: dict[str, float] | None = None
    best_eval: dict[str, float] | None = None
    best_epoch: int | None = None
    best_step: int | None = None
    stop_requested: bool = False
    rolled_back: bool = False
    rank_times: list[dict[str, float]] | None = None
    lost_samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """Where training is, without what is transient (see :data:`TRANSIENT`)."""
        return {k: v for k, v in asdict(self).items() if k not in TRANSIENT}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; transient fields in an older checkpoint are ignored."""
        for key, value in state.items():
            if key not in TRANSIENT:
                setattr(self, key, value)


#: Fields that describe the moment, not the position: a resumed run never inherits them (a
#: stop agreed at a checkpoint step would otherwise stop the resumed run again), and
#: ``n_epochs``/``total_steps`` come from the resumed run's own options.
TRANSIENT = frozenset(
    {
        "batch_idx",
        "is_update",
        "is_filler",
        "stop_requested",
        "rolled_back",
        "rank_times",
        "n_epochs",
        "total_steps",
    }
)
