"""Under Ray Train: the trainer's checkpoints and metrics reported to Ray, and Ray's newest
checkpoint resumed from.

The training function runs unchanged inside ``ray.train.torch.TorchTrainer``. Each checkpoint
the trainer writes is reported with ``ray.train.report`` by every rank (Ray's report is a
barrier of all workers), rank 0 handing over the checkpoint and a manifest that lists it, with
the metrics of :func:`ray_metrics`: Ray copies it to its storage and keeps the metrics with it,
so ``result.checkpoint`` and ``result.metrics`` are those of the last one.

``train(resume="auto")`` first copies Ray's newest checkpoint (``ray.train.get_checkpoint()``:
after Ray restarted the workers, or in a run restored by name) into the checkpoint directory,
unless that holds one as new: a worker on a fresh node, with an empty ``save_path``, resumes
where the run stood, on as many workers as Ray now gives it.
"""

from __future__ import annotations

import tempfile

from fastdist.checkpoint.files import CheckpointDir
from fastdist.logging import logger
from fastdist.state import TrainerState


class RayReport:
    """The checkpointer's mirror (:class:`~fastdist.checkpoint.checkpointer.Mirror`) in a Ray
    Train worker; ``state`` gives the metrics reported with each checkpoint."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state

    def fetch(self, directory: CheckpointDir) -> None:
        """Copy Ray's newest checkpoint into ``directory`` unless it holds one as new."""
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return
        with checkpoint.as_directory() as source:
            step = directory.import_newest(source)
        if step is not None:
            logger.info(
                "Ray Train's newest checkpoint (step %d) copied into %s", step, directory.directory
            )

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


def ray_metrics(state: TrainerState) -> dict[str, float]:
    """``epoch``, ``step``, the last logged ``loss``, the last evaluation as ``dev/<key>`` and
    the best as ``best/<key>`` (the names of the TensorBoard callback)."""
    metrics: dict[str, float] = {"epoch": state.epoch, "step": state.global_step}
    if state.loss is not None:
        metrics["loss"] = state.loss
    for prefix, result in (("dev", state.eval_result), ("best", state.best_eval)):
        metrics.update({f"{prefix}/{key}": value for key, value in (result or {}).items()})
    return metrics
