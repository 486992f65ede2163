"""Keeping the best evaluated weights (rank 0) and handing them to every rank at the end."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from fastdist.distributed import broadcast_tensors
from fastdist.trainer.checkpoint import atomic_save


class BestModel:
    """Rank 0 keeps the best weights: in a file under ``save_path``, else (if they will be
    loaded at the end) in memory. The file name carries the run's start time, so a new run
    never overwrites an earlier run's best model.
    """

    def __init__(self, model: nn.Module, save_path: str | None, keep_in_memory: bool) -> None:
        self.model = model
        self.save_path = save_path
        self.keep_in_memory = keep_in_memory
        self.path: str | None = None
        self._weights: dict[str, torch.Tensor] | None = None

    def save(self, metric_key: str) -> None:
        """Called on rank 0 when an evaluation is the best so far."""
        weights = self.model.state_dict()
        if self.save_path is None:
            if self.keep_in_memory:
                self._weights = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
            return
        if self.path is None:
            stamp = time.strftime("%Y-%m-%d-%H-%M-%S")
            name = f"best_{type(self.model).__name__}_{metric_key}_{stamp}.pt"
            self.path = os.path.join(self.save_path, name)
        atomic_save(weights, self.path)

    def load(self, is_master: bool, group: Any) -> None:
        """Rank 0 loads the best weights; a broadcast gives them to every other rank."""
        if is_master:
            if self.path is not None:
                device = next(iter(self.model.state_dict().values())).device
                weights = torch.load(self.path, map_location=device, weights_only=True)
                self.model.load_state_dict(weights)
            elif self._weights is not None:
                self.model.load_state_dict(self._weights)
        with torch.no_grad():
            broadcast_tensors(self.model.state_dict().values(), group=group)
