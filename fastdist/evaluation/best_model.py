"""Keeping the best evaluated weights (rank 0) and handing them to every rank at the end."""

from __future__ import annotations

import os
import time
from typing import Any

from fastdist.checkpoint.export import SUFFIXES, read_model, write_model
from fastdist.checkpoint.files import claim_new
from fastdist.distributed import get_rank
from fastdist.strategies import Strategy, model_class


class BestModel:
    """Rank 0 keeps the best weights, whole and unsharded (they load into the model without
    fastdist): in a file (or a Hugging Face folder) under ``save_path``, named for the
    model's own class under every strategy, else (if they will be loaded at the end) in
    memory. The name carries the time of the run's first best evaluation, and is claimed
    exclusively (``-2``, ``-3``... appended if taken), so a run never overwrites another run's
    best model, even one sharing ``save_path`` and the second. A checkpoint part: it saves
    the file's path, or the weights it keeps in memory (rank 0's, so that a resumed run ends
    with the best of the whole run, not of its own part).

    Args:
        format: how the file is written (:data:`~fastdist.checkpoint.export.FORMATS`).
    """

    def __init__(
        self,
        strategy: Strategy,
        save_path: str | None,
        keep_in_memory: bool,
        format: str = "torch",
    ) -> None:
        self.strategy = strategy
        self.save_path = save_path
        self.keep_in_memory = keep_in_memory
        self.format = format
        self.path: str | None = None
        self._weights: dict[str, Any] | None = None

    def save(self, metric_key: str) -> None:
        """Called on every rank when an evaluation is the best so far (FSDP gathers)."""
        if self.save_path is None and not self.keep_in_memory:
            return
        weights = self.strategy.full_state_dict()
        if weights is None:  # not rank 0
            return
        if self.save_path is None:
            self._weights = weights
            return
        if self.path is None:
            stamp = time.strftime("%Y-%m-%d-%H-%M-%S")
            cls = model_class(self.strategy.model).__name__  # not FSDP's FSDP<Name>
            stem = os.path.join(self.save_path, f"best_{cls}_{metric_key}_{stamp}")
            os.makedirs(self.save_path, exist_ok=True)
            self.path = claim_new(stem, SUFFIXES[self.format], folder=self.format == "hf")
        write_model(weights, self.path, self.format, self.strategy.model)

    def load(self, is_master: bool) -> None:
        """Rank 0 loads the best weights; every rank then holds them (a collective)."""
        weights = None
        if is_master and self.path is not None:
            weights = read_model(self.path, model_class(self.strategy.model))
        elif is_master:
            weights = self._weights
        self.strategy.load_full_state_dict(weights)

    def state_dict(self) -> dict[str, Any]:
        return {"path": self.path, "weights": self._weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        if get_rank() == 0:  # only rank 0 keeps the weights (absent in format 1)
            self._weights = state.get("weights")
