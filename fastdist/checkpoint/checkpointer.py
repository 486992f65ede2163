"""When to checkpoint and where from to resume; a no-op when there is no checkpoint directory."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastdist.distributed import all_gather_object
from fastdist.logging import logger
from fastdist.trainer.checkpoint import (
    SHARDED_REST,
    CheckpointDir,
    atomic_save,
    load_checkpoint,
    rng_state,
)
from fastdist.trainer.sharded_checkpoint import load_shards, publish, write_shards

if TYPE_CHECKING:
    from fastdist.trainer.dist_trainer import DistTrainer


class Checkpointer:
    """Saves ``trainer.state_dict()`` plus every rank's RNG state and data position (a
    stream's loader state); finds one to resume from.

    Args:
        directory: where checkpoints go; ``None`` disables checkpointing (every method then
            does nothing, so the loop calls them unconditionally).
        every: also checkpoint every N optimizer updates (0: at epoch ends only).
        keep: how many of the newest checkpoints to keep.
        sharded: every rank writes its shard of the model and optimizer state with DCP
            (``strategy="fsdp"``, also on one process, so that any world size resumes it).
    """

    def __init__(self, directory: str | None, every: int, keep: int, sharded: bool) -> None:
        self.dir = CheckpointDir(directory, keep) if directory else None
        self.every = every
        self.sharded = sharded

    def due(self, step: int) -> bool:
        """Whether the schedule asks for a checkpoint after update ``step``."""
        return self.dir is not None and self.every > 0 and step % self.every == 0

    def save(self, trainer: DistTrainer) -> None:
        """Gather every rank's RNG state and data position (a collective), then rank 0 writes
        the checkpoint."""
        if self.dir is None:
            return
        ranks = all_gather_object((rng_state(), trainer.data.state_dict()), trainer.group)
        per_rank = {"rng": [rng for rng, _ in ranks], "data": [data for _, data in ranks]}
        step = trainer.state.global_step
        if self.sharded:
            path = self._save_sharded(trainer, dict(trainer.state_dict(), **per_rank), step)
        elif trainer.is_master:
            path = self.dir.save(dict(trainer.state_dict(), **per_rank), step)
        if trainer.is_master:
            logger.info("checkpoint written: %s", path)

    def _save_sharded(self, trainer: DistTrainer, rest: dict[str, Any], step: int) -> str:
        """Shards by every rank into a temp dir, the rest by rank 0, one rename, the manifest."""
        assert self.dir is not None
        path = os.path.join(self.dir.directory, f"step-{step:08d}")
        tmp = os.path.join(self.dir.directory, f".tmp-step-{step:08d}")
        group, master = trainer.group, trainer.is_master
        write_shards(trainer.model, trainer.optimizer, tmp, master, group)
        if master:
            crc32 = atomic_save(rest, os.path.join(tmp, SHARDED_REST))
        publish(tmp, path, group, master)  # after every rank finished writing
        if master:
            self.dir.record(path, crc32, step)
        return path

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


def trainer_state_dict(trainer: DistTrainer) -> dict[str, Any]:
    """Everything a resumed run needs: a dict of the state dicts of every stateful part
    (with sharded checkpoints, all but the model and optimizer, which DCP writes)."""
    tensors = {}
    if not trainer.checkpointer.sharded:
        model, optimizer = trainer.model.state_dict(), trainer.optimizer.state_dict()
        tensors = {"model": model, "optimizer": optimizer}
    return {
        "format": 1,
        **tensors,
        "callbacks_all": [cb.state_dict() for cb in trainer.callbacks_all],
        "callbacks_master": [cb.state_dict() for cb in trainer.callbacks_master],
        "trainer": trainer.state.state_dict(),
        "precision": trainer.precision.state_dict(),
        "ddp": trainer.strategy.state_dict(),
        "best_model_path": trainer.best.path,
        "world_size": trainer.world_size,
        "seed": trainer.config.seed,
    }


def load_trainer_state_dict(trainer: DistTrainer, checkpoint: dict[str, Any]) -> None:
    """Restore what :func:`trainer_state_dict` returned (plus the checkpoint's per-rank ``rng``
    and ``data`` lists). Raises ``ValueError`` on every rank, before any collective, if the
    trainer's callbacks do not match the checkpoint's."""
    for name in ("callbacks_all", "callbacks_master"):  # the same lists on every rank
        have, saved = len(getattr(trainer, name)), len(checkpoint[name])
        if have != saved:
            raise ValueError(
                f"the checkpoint holds {saved} {name} state(s) but the trainer has {have} "
                f"{name}: resume with the callbacks of the run that wrote it, in its order, or "
                "start afresh with train(resume=False) or another save_path"
            )
    if "sharded_dir" in checkpoint:
        load_shards(trainer.model, trainer.optimizer, checkpoint["sharded_dir"], trainer.group)
    else:
        trainer.model.load_state_dict(checkpoint["model"])
        trainer.optimizer.load_state_dict(checkpoint["optimizer"])
    callbacks = [*zip(trainer.callbacks_all, checkpoint["callbacks_all"], strict=True)]
    if trainer.is_master:  # callbacks_master run (and were saved) on rank 0 only
        callbacks += zip(trainer.callbacks_master, checkpoint["callbacks_master"], strict=True)
    for cb, cb_state in callbacks:
        cb.load_state_dict(cb_state)
    state = trainer.state
    state.load_state_dict(checkpoint["trainer"])
    state.n_epochs = trainer.config.n_epochs
    trainer.precision.load_state_dict(checkpoint["precision"])
    trainer.strategy.load_state_dict(checkpoint["ddp"])
    trainer.best.path = checkpoint["best_model_path"]
    rngs = checkpoint.get("rng", [])
    trainer._resume_rng = rngs[trainer.rank] if trainer.rank < len(rngs) else None
    datas = checkpoint.get("data", [])
    own = datas[trainer.rank] if len(datas) == trainer.world_size else None
    mid_epoch = not state.epoch_complete and (state.samples_in_epoch or state.batches_in_epoch)
    if mid_epoch and not trainer.data.resume(own):  # a stream that cannot continue: restart
        state.samples_in_epoch = state.batches_in_epoch = 0
    if checkpoint["world_size"] != trainer.world_size:
        cfg = trainer.config
        logger.warning(
            "resuming a %d-process run on %d processes: the rest of the epoch is sharded "
            "anew; global batch now %d",
            checkpoint["world_size"],
            trainer.world_size,
            cfg.batch_size_per_gpu * trainer.world_size * cfg.update_every,
        )
