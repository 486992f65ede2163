"""Keeping the best evaluated weights (rank 0) and handing them to every rank at the end."""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Any

from fastdist.checkpoint.export import SUFFIXES, read_model, write_model
from fastdist.checkpoint.files import claim_new, crc32, remove, write_failure
from fastdist.checkpoint.temps import PREFIX, clean
from fastdist.distributed import agreed, broadcast_object, get_rank
from fastdist.logging import logger
from fastdist.strategies import Strategy, model_class


class BestModel:
    """Rank 0 keeps the best weights, whole and unsharded (they load into the model without
    fastdist): in a file (or a Hugging Face folder) under ``save_path``, named for the
    model's own class under every strategy, else (if they will be loaded at the end) in
    memory. The name carries the time of the run's first best evaluation, and is claimed
    exclusively (``-2``, ``-3``... appended if taken), so a run never overwrites another run's
    best model, even one sharing ``save_path`` and the second. A checkpoint part: it saves
    the file's path, or the weights it keeps in memory (rank 0's, so that a resumed run ends
    with the best of the whole run, not of its own part). A torchft replica group that heals
    from a peer takes the peer's best weights into a file of its own (the peer's may be on
    another machine).

    Args:
        metric_key: the metric the best is judged by (in the file's name).
        format: how the file is written (:data:`~fastdist.checkpoint.export.FORMATS`).
        group: the process group whose ranks agree on a failed write.
    """

    def __init__(
        self,
        strategy: Strategy,
        save_path: str | None,
        keep_in_memory: bool,
        metric_key: str,
        format: str = "torch",
        group: Any = None,
    ) -> None:
        self.strategy = strategy
        self.metric_key = metric_key
        self.group = group
        self.save_path = save_path
        self.keep_in_memory = keep_in_memory
        self.format = format
        self.path: str | None = None
        self.checksums: dict[str, int] | None = None  # of the file as written (rank 0)
        self._weights: dict[str, Any] | None = None

    def save(self) -> None:
        """Called on every rank when an evaluation is the best so far (FSDP gathers). A file
        that cannot be written (a full disk) raises the same ``OSError`` on every rank."""
        if self.save_path is None and not self.keep_in_memory:
            return
        weights = self.strategy.full_state_dict()
        if self.save_path is None:
            if weights is not None:  # rank 0; a resumed run's file is older than these
                self._weights, self.path, self.checksums = weights, None, None
            return
        agreed(lambda: None if weights is None else self._write(weights), self.group)

    def _write(self, weights: dict[str, Any]) -> None:
        """Rank 0: write ``weights`` to the run's best-model file, claimed at its first call;
        on failure the file claimed then is removed, and the error names it."""
        claimed = self.path is None
        if self.path is None:
            assert self.save_path is not None
            stamp = time.strftime("%Y-%m-%d-%H-%M-%S")
            cls = model_class(self.strategy.model).__name__  # not FSDP's FSDP<Name>
            stem = os.path.join(self.save_path, f"best_{cls}_{self.metric_key}_{stamp}")
            os.makedirs(self.save_path, exist_ok=True)
            self.path = claim_new(stem, SUFFIXES[self.format], folder=self.format == "hf")
        path = self.path
        try:
            write_model(weights, path, self.format, self.strategy.model)
            self.checksums = checksums(path)
        except (OSError, RuntimeError) as exc:
            if claimed:  # empty: nothing of the user's
                remove(path)
                self.path = None
            cause = exc.__cause__ or exc  # atomic_save's own words speak of a checkpoint
            fix = "free space or use another save_path"
            raise OSError(write_failure("the best model", path, weights, cause, fix)) from exc

    def remove_dead_writes(self) -> None:
        """As a run starts, on rank 0, which holds ``save_path``'s lock: remove what writes of
        this model's best killed before their rename left there: each temp (unlocked) named
        for a best-model file or folder of this model and metric, and that name if it is
        still empty (claimed by the killed write: a file of 0 bytes, an empty folder). Nothing
        else is touched."""
        if self.save_path is None or get_rank() != 0 or not os.path.isdir(self.save_path):
            return
        stem = f"best_{model_class(self.strategy.model).__name__}_{self.metric_key}_"
        ours = re.compile(re.escape(stem) + r"\d{4}(-\d\d){5}(-\d+)?(\.[a-z]+)?$")
        names = [name for name in os.listdir(self.save_path) if ours.match(name)]
        if not names:
            return
        temps = re.compile(r"\.tmp-[0-9a-f]{32}-(" + "|".join(map(re.escape, names)) + ")$")
        claimed = []
        for name in sorted({temp[PREFIX:] for temp in clean(self.save_path, "best-model", temps)}):
            path = os.path.join(self.save_path, name)
            with contextlib.suppress(OSError):  # a folder with files: a write that finished
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)  # empty only
                elif os.path.isfile(path) and os.path.getsize(path) == 0:
                    os.remove(path)
                claimed += [] if os.path.lexists(path) else [name]
        if claimed:
            logger.info(
                "removed %d empty best-model name(s) that killed writes claimed from %s: %s",
                len(claimed),
                self.save_path,
                ", ".join(claimed),
            )

    def load(self, is_master: bool, epoch: int | None, step: int | None) -> None:
        """Rank 0 loads the best weights (of ``epoch`` and ``step``, for the log); every rank
        then holds them (collectives). A file that cannot be read or changed since it was
        written (its CRC-32: damaged, or replaced by another model's) raises the same
        ``OSError`` on every rank, naming it. After a resume that found the file changed (see
        :meth:`load_state_dict`) and wrote no best since, the model keeps its weights."""

        def read() -> dict[str, Any] | None:
            if not is_master or self.path is None:
                return self._weights if is_master else None
            try:
                if self.checksums is not None and checksums(self.path) != self.checksums:
                    raise ValueError("its contents differ from what was written (CRC-32)")
                weights = read_model(self.path, model_class(self.strategy.model))
            except Exception as exc:  # torch's and safetensors' words name no file
                raise OSError(
                    f"load_best_model: the best model {self.path} cannot be read "
                    f"({type(exc).__name__}: {exc}); it was damaged, replaced or removed since "
                    "it was written: the model keeps its last weights (the checkpoints are intact)"
                ) from exc
            return weights

        weights = agreed(read, self.group)
        if not broadcast_object(weights is not None, group=self.group):
            logger.warning(
                "the best model of epoch %d step %d is not on disk (see the warning at the "
                "resume): the model keeps its last weights",
                epoch,
                step,
            )
            return
        self.strategy.load_full_state_dict(weights)
        logger.info("loaded the best model of epoch %d step %d", epoch, step)

    def state_dict(self) -> dict[str, Any]:
        return {"path": self.path, "weights": self._weights, "checksums": self.checksums}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """On resume. The file is looked up by its name in this run's ``save_path``: a
        ``save_path`` copied or moved with its checkpoints resumes with its own file, and
        nothing is written into the one it came from. A best-model file that is not as the
        checkpoint recorded it (the stopped run wrote a later best after that checkpoint, or it
        was changed or removed since) is left as it is: this run's next best goes to a new
        file."""
        self.path, self.checksums = state["path"], state.get("checksums")  # none in older ones
        if self.path is not None and self.save_path is not None:
            self.path = os.path.join(self.save_path, os.path.basename(self.path))
        if get_rank() != 0:
            return
        self._weights = state.get("weights")  # only rank 0 keeps them (absent in format 1)
        if self.path is None or self.checksums is None:
            return
        try:
            kept = checksums(self.path) == self.checksums
        except OSError:
            kept = False
        if not kept:
            logger.warning(
                "the best model %s is not as the checkpoint this run resumes from recorded it "
                "(the stopped run wrote a later best after that checkpoint, or it was changed "
                "or removed since): it is left as it is; this run's next best goes to a new file",
                self.path,
            )
            self.path = self.checksums = None

    def live_state_dict(self) -> dict[str, Any]:
        """What a healing peer group takes (torchft): the best weights themselves (rank 0's;
        read from this group's file, which the peer may not see), not the file's path."""
        weights = self._weights
        if self.path is not None and get_rank() == 0:
            weights = read_model(self.path, model_class(self.strategy.model))
        return {"path": None, "weights": weights}

    def load_live_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer group's best weights (:meth:`live_state_dict`): rank 0 writes them to
        this group's own best-model file (claimed if it has none), or keeps them in memory."""
        weights = state["weights"]
        if get_rank() != 0 or weights is None:
            return
        if self.save_path is None:
            self._weights = weights
        else:  # no collective here: torchft heals on each rank alone
            self._write(weights)


def checksums(path: str) -> dict[str, int]:
    """The CRC-32 of the file ``path``, or of each file of the folder ``path`` (``"hf"``)."""
    if not os.path.isdir(path):
        return {"": crc32(path)}
    return {name: crc32(os.path.join(path, name)) for name in sorted(os.listdir(path))}
