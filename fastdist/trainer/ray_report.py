"""Under Ray Train: the trainer's checkpoints and metrics reported to Ray, and Ray's newest
checkpoint resumed from.

The training function runs unchanged inside ``ray.train.torch.TorchTrainer``. Each checkpoint
the trainer writes is reported with ``ray.train.report`` by every rank (Ray's report is a
barrier of all workers), rank 0 handing over the checkpoint and a manifest that lists it, with
the metrics of :func:`ray_metrics`: Ray copies it to its storage and keeps the metrics with it,
so ``result.checkpoint`` and ``result.metrics`` are those of the last one.

``train(resume="auto")`` first copies the newest checkpoint of the run's storage that
verifies (after Ray restarted the workers, or in a run restored by name) into the checkpoint
directory, unless that holds one as new: a worker on a fresh node, with an empty
``save_path``, resumes where the run stood, on as many workers as Ray now gives it. The
storage is listed, not only ``ray.train.get_checkpoint()`` asked: Ray registers a report
asynchronously and forgets one reported just before a worker died.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from fastdist.checkpoint.files import CheckpointDir, expected_checksums
from fastdist.checkpoint.resume import Candidate, unverified
from fastdist.logging import logger
from fastdist.state import TrainerState


class RayReport:
    """The checkpointer's mirror (:class:`~fastdist.checkpoint.checkpointer.Mirror`) in a Ray
    Train worker; ``state`` gives the metrics reported with each checkpoint."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    def fetch(self, directory: CheckpointDir) -> None:
        """Copy the newest checkpoint of the run's storage that verifies into ``directory``,
        unless that holds one as new. The storage's own listing comes first: Ray registers a
        report asynchronously, so ``get_checkpoint()`` misses one reported just before a
        worker died, although its files are in the storage."""
        import ray.train

        reported = ray.train.get_checkpoint()
        for checkpoint in [*_stored_checkpoints(), *([reported] if reported else [])]:
            with checkpoint.as_directory() as source:
                problem = _unverified(source)
                if problem is not None:
                    logger.warning("skipping Ray Train's checkpoint %s: %s", source, problem)
                    continue
                step = directory.import_newest(source)
            if step is not None:
                logger.info(
                    "Ray Train's newest checkpoint (step %d, %s) copied into %s",
                    step,
                    checkpoint.path,
                    directory.directory,
                )
            return

    def publish(self, directory: CheckpointDir, path: str | None) -> None:
        """Report the metrics on every rank, with the checkpoint ``path`` on rank 0."""
        import ray.train

        metrics = ray_metrics(self.state)
        if path is None:
            ray.train.report(metrics)
            return
        # Staged next to the checkpoint, so that hard links do (Ray copies the files).
        with tempfile.TemporaryDirectory(prefix=".tmp-ray-", dir=directory.directory) as staged:
            directory.export(path, staged)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(staged))


def _stored_checkpoints() -> list[Any]:
    """The ``checkpoint_*`` directories in the run's storage, newest first (their names are
    their times), as Ray ``Checkpoint`` objects; none if the storage cannot be listed."""
    import pyarrow.fs
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()  # a DeveloperAPI of Ray Train
        found = storage.storage_filesystem.get_file_info(
            pyarrow.fs.FileSelector(storage.experiment_fs_path, allow_not_found=True)
        )
    except Exception as exc:  # another Ray version, a storage that fails: Ray's own choice
        logger.warning("cannot list the Ray run's storage (%s): resuming from Ray's choice", exc)
        return []
    names = [
        info.path
        for info in found
        if info.type == pyarrow.fs.FileType.Directory and info.base_name.startswith("checkpoint_")
    ]
    fs = storage.storage_filesystem
    return [ray.train.Checkpoint(path, filesystem=fs) for path in sorted(names, reverse=True)]


def _unverified(source: str) -> str | None:
    """What is wrong with the newest checkpoint the manifest of ``source`` lists; ``None``."""
    try:
        entries = CheckpointDir(source, keep=1).entries()
    except ValueError as exc:
        return str(exc)
    if not entries:
        return "it holds no manifest.json listing a checkpoint"
    path = os.path.join(source, entries[-1]["file"])
    return unverified(Candidate(path, expected_checksums(source, entries[-1])))


def ray_metrics(state: TrainerState) -> dict[str, float]:
    """``epoch``, ``step``, the last logged ``loss``, the last evaluation as ``dev/<key>`` and
    the best as ``best/<key>`` (the names of the TensorBoard callback)."""
    metrics: dict[str, float] = {"epoch": state.epoch, "step": state.global_step}
    if state.loss is not None:
        metrics["loss"] = state.loss
    for prefix, result in (("dev", state.eval_result), ("best", state.best_eval)):
        metrics.update({f"{prefix}/{key}": value for key, value in (result or {}).items()})
    return metrics
