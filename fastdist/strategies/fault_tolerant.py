"""What ``DDP(fault_tolerant=True)`` and ``FSDP(fault_tolerant=True)`` share: the replica
groups of :mod:`~fastdist.strategies.replica_groups` joined from the strategy, and the
optimizer stepped only on the updates torchft commits (:class:`Gated`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastdist.state import TrainerState
from fastdist.strategies.base import Strategy, Update
from fastdist.strategies.replica_groups import ReplicaGroups, replica_layout


class FaultTolerantStrategy(Strategy):
    """What ``DDP`` and ``FSDP`` share under ``fault_tolerant``: the launch's replica group,
    torchft's quorum before each update, the averages across the groups, the heal's peer and
    torchft's counters in the strategy's checkpoint part."""

    torchft: ReplicaGroups | None = None

    def _replica_options(self, strategy: str, fault_tolerant: bool, min_replicas: int) -> None:
        self.fault_tolerant, self.min_replicas = fault_tolerant, min_replicas
        self.replica_group = replica_layout(strategy, fault_tolerant, min_replicas)

    def _join(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any, timeout: float | None
    ) -> tuple[Any, torch.optim.Optimizer]:
        """Join torchft's replica groups (this group's ranks in ``group``): torchft's manager,
        and ``optimizer`` stepping only on committed updates. The groups heal this strategy's
        checkpoint parts from one another."""
        index, count = self.replica_group
        groups = ReplicaGroups(index, count, self.min_replicas, timeout or 60.0)
        self.torchft = self.peer = groups
        return groups.start(model, group), Gated(optimizer, groups)

    def average_over_groups(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.torchft is None else self.torchft.average(tensor)

    def bind(self, state: TrainerState, update_samples: Callable[[], list[int]]) -> None:
        if self.torchft is not None:
            self.torchft.bind(state, update_samples)

    def forward_backward(self, update: Update) -> None:
        """The update, after torchft's quorum (which may heal this group) if fault tolerant."""
        if self.torchft is not None:
            self.torchft.start_update()
        super().forward_backward(update)

    def skipped_update(self) -> None:
        if self.torchft is not None:
            self.torchft.skipped()

    def state_dict(self) -> dict[str, Any]:
        """torchft's step and committed batches: a disk checkpoint resumes them."""
        return {"torchft": self.torchft.state_dict()} if self.torchft is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.torchft is not None and "torchft" in state:
            self.torchft.load_state_dict(state["torchft"])


class Gated(torch.optim.Optimizer):
    """``optimizer`` stepped only when torchft commits the update (``step`` returns whether
    it did); everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: ReplicaGroups) -> None:
        self.optim, self.groups = optimizer, groups

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def step(self, closure: Any = None) -> bool:  # type: ignore[override]
        if closure is not None:
            raise ValueError("fault_tolerant=True takes optimizers without a closure")
        if not self.groups.commit():
            return False
        self.optim.step()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optim.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state."""
        self.optim.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"Gated({self.optim!r})"
