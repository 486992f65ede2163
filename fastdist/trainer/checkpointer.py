"""When to checkpoint and where from to resume; a no-op when there is no checkpoint directory."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastdist.distributed import all_gather_object
from fastdist.logging import logger
from fastdist.trainer.checkpoint import CheckpointDir, load_checkpoint, rng_state

if TYPE_CHECKING:
    from fastdist.trainer.dist_trainer import DistTrainer


class Checkpointer:
    """Saves ``trainer.state_dict()`` plus every rank's RNG state; finds one to resume from.

    Args:
        directory: where checkpoints go; ``None`` disables checkpointing (every method then
            does nothing, so the loop calls them unconditionally).
        every: also checkpoint every N optimizer updates (0: at epoch ends only).
        keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, directory: str | None, every: int, keep: int) -> None:
        self.dir = CheckpointDir(directory, keep) if directory else None
        self.every = every

    def due(self, step: int) -> bool:
        """Whether the schedule asks for a checkpoint after update ``step``."""
        return self.dir is not None and self.every > 0 and step % self.every == 0

    def save(self, trainer: DistTrainer) -> None:
        """Gather every rank's RNG state (a collective), then rank 0 writes the checkpoint."""
        if self.dir is None:
            return
        rngs = all_gather_object(rng_state(), trainer.group)
        if trainer.is_master:
            path = self.dir.save(dict(trainer.state_dict(), rng=rngs), trainer.state.global_step)
            logger.info("checkpoint written: %s", path)

    def find(self, resume: bool | str | os.PathLike) -> tuple[dict[str, Any], str] | None:
        """The checkpoint ``train(resume=...)`` asks for, with its path, or ``None``.

        ``"auto"``: the newest valid checkpoint in the directory, if any; a path: that file;
        ``False``: none.
        """
        if resume is False:
            return None
        if resume == "auto":
            return None if self.dir is None else self.dir.load_latest()
        path = os.fspath(resume)  # type: ignore[arg-type]
        return load_checkpoint(path), path
