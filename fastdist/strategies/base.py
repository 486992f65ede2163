"""The small interface the training loop calls; the base class is one process, no parallelism."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from fastdist.distributed import broadcast_tensors, get_rank


class Strategy:
    """How the model is parallelised: the loop calls only these methods, never asks which.

    The base class runs the model as it is (one process, or a strategy that shares nothing);
    every method is then a no-op, so the loop calls them unconditionally.

    Args:
        device: this rank's device.
        group: the process group of the trainer's collectives (``None``: the default group).
    """

    name = "none"

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        self.module: nn.Module  # what the training forward runs through; set by wrap()

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Prepare ``model`` (already on the device) for training; return the optimizer to use.

        Sets :attr:`module`. A strategy that replaces the parameters repoints the optimizer.
        """
        self.module = model
        return optimizer

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context of a micro-batch whose gradients are not reduced (inside a window)."""
        return contextlib.nullcontext()

    def after_step(self, model: nn.Module, step: int) -> None:
        """Called after optimizer update ``step`` (e.g. local SGD's parameter averaging)."""

    def broadcast_buffers(self, model: nn.Module) -> None:
        """Give every rank rank 0's buffers (batch-norm statistics) before evaluating."""
        with torch.no_grad():
            broadcast_tensors(model.buffers(), group=self.group)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any] | None:
        """The whole model's ``state_dict`` on rank 0 (``None`` elsewhere), to save or keep."""
        if get_rank() != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def load_full_state_dict(self, model: nn.Module, weights: dict[str, Any] | None) -> None:
        """Load rank 0's ``weights`` (``None`` on the other ranks) into every rank's model."""
        if weights is not None:
            model.load_state_dict(weights)
        with torch.no_grad():
            broadcast_tensors(model.state_dict().values(), group=self.group)

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own resumable state (e.g. a communication hook's), plain data."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
