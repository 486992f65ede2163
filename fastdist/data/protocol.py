"""The interface of a rank's training batches, which the training loop walks pass by pass.

:class:`~fastdist.data.TrainBatches` (map-style data, a sampler or batch sampler) and
:class:`~fastdist.data.StreamBatches` (an ``IterableDataset``) implement it. A *pass* is an
epoch from a position ``(samples, batches)``: what all ranks together already trained on, 0 at
an epoch's start. Every rank runs equally many micro-batches per pass; a shorter shard runs
*fillers* (weight 0) to stay in step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol


class Batches(Protocol):
    """This rank's micro-batches of every pass, their loss weights and the position after them.

    It is a per-rank checkpoint part: ``state_dict`` is this rank's reading position where the
    trainer's ``(samples, batches)`` is not enough (a stream's loader state), else ``None``.
    """

    #: Loss weight of each of this rank's micro-batches of the current pass (0: a filler).
    weights: list[float]
    #: Samples in each of them (0: a filler; 1 per batch of a user's batch sampler, whose
    #: batches weigh equally).
    samples: list[int]
    #: The DataLoader this rank reads.
    loader: Any

    @property
    def plans_uneven(self) -> bool:
        """Whether every rank's batch sizes are known (else a user sampler must give equal
        shards)."""

    def n_updates(self, epoch: int, samples: int = 0, batches: int = 0) -> int | None:
        """Optimizer updates every rank runs in a pass from this position (``None``:
        unknown)."""

    def begin(self, epoch: int, samples: int, batches: int) -> None:
        """Start a pass of ``epoch`` from the position ``(samples, batches)``."""

    def iterate(self) -> Iterator[Any]:
        """This rank's batches of the pass, fillers included (``iter()`` of the loader runs
        now: it draws from the torch RNG)."""

    def ends_window(self, done: int) -> bool:
        """Whether ``done`` micro-batches of the pass end an update window (the windows are
        the data's: ``update_every`` micro-batches, or fewer at the end of a pass)."""

    def ends_pass(self, done: int, wait: bool = False) -> bool:
        """Whether ``done`` micro-batches are known to be the whole pass (``wait``: a stream
        waits for what tells, where that is under way)."""

    def position(self, done: int) -> tuple[int, int]:
        """``(samples, batches)`` of the epoch done by all ranks after ``done`` micro-batches
        of this pass each (``done`` ends an update)."""

    def resume_at(self, samples: int, batches: int) -> tuple[int, int]:
        """The position to continue an interrupted epoch from, given the checkpoint's: the same,
        or ``(0, 0)`` (with a warning saying why) where the epoch must restart."""

    def state_dict(self) -> Any:
        """This rank's reading position beyond ``(samples, batches)``, or ``None``."""

    def load_state_dict(self, state: Any) -> None:
        """Restore this rank's :meth:`state_dict` (same world size)."""

    def load_resized(self, states: list[Any]) -> None:
        """The checkpoint was written by ``len(states)`` processes, not this world size."""
