"""A pipeline's checkpoint parts: the whole model and optimizer state gathered from its
stages, as a plain or DDP run holds them, and each stage's part taken back from them; whole
tensors made from and cut into a stage's shards where its stage strategy shards them (FSDP).
FSDP stages' checkpoints are DCP shards instead, as a plain FSDP run writes them
(:class:`StageShards`, :class:`StageOptimizerShards`): DCP reshards them onto any layout.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from fastdist.distributed import gather_object
from fastdist.distributed.dtensor import is_dtensor


class Stages(Protocol):
    """What the parts read of the pipeline strategy."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    groups: list[list[str]]  # the names of the user's optimizer groups' parameters
    group: Any

    def owns(self, name: str) -> bool: ...

    def full_state_dict(self) -> dict[str, Any] | None: ...


def whole(value: Any) -> Any:
    """``value`` with every tensor whole on the CPU (a DTensor gathered: a collective)."""
    if is_dtensor(value):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: whole(v) for k, v in value.items()}
    return value


def cut_like(value: Any, like: torch.Tensor) -> Any:
    """The whole tensor ``value`` as ``like`` holds it: this rank's shard of a DTensor (no
    communication), or a plain tensor on its device; anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.shape != like.shape:
        return value
    value = value.to(like.device, like.dtype)
    if is_dtensor(like):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    return value


def load_whole(model: nn.Module, state: dict[str, Any]) -> None:
    """Load the whole ``state`` into ``model``, whose own stage may hold shards."""
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            tensor.copy_(cut_like(state[name], tensor))
    unexpected = sorted(set(state) - set(model.state_dict()))
    if unexpected:
        raise KeyError(f"the checkpoint's model holds entries the model does not: {unexpected}")


class WholeModel:
    """The whole model's state, gathered from the stages (rank 0's saved; a collective)."""

    def __init__(self, pipeline: Stages) -> None:
        self.pipeline = pipeline

    def state_dict(self) -> dict[str, Any]:
        return self.pipeline.full_state_dict() or {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_whole(self.pipeline.model, state)


class WholeOptimizer:
    """The optimizer state of the whole model, as the user's optimizer over every parameter
    would hold it: the stages' states gathered to rank 0 (a collective), each stage loading
    its own part back."""

    def __init__(self, pipeline: Stages) -> None:
        self.pipeline, self.optimizer = pipeline, pipeline.optimizer
        self.order = [name for names in pipeline.groups for name in names]
        self.own = [name for name in self.order if pipeline.owns(name)]

    def state_dict(self) -> dict[str, Any]:
        stage = self.optimizer.state_dict()
        mine = {self.own[i]: whole(state) for i, state in stage["state"].items()}
        everyone = gather_object(mine, self.pipeline.group)
        if everyone is None:
            return {}
        merged = {name: state for states in everyone for name, state in states.items()}
        groups, start = [], 0
        for group, names in zip(stage["param_groups"], self.pipeline.groups, strict=True):
            groups.append({**group, "params": list(range(start, start + len(names)))})
            start += len(names)
        state = {i: merged[name] for i, name in enumerate(self.order) if name in merged}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        index = {name: i for i, name in enumerate(self.order)}
        params = dict(self.pipeline.model.named_parameters())
        groups, start = [], 0
        for group, names in zip(saved["param_groups"], self.pipeline.groups, strict=True):
            count = sum(self.pipeline.owns(name) for name in names)
            groups.append({**group, "params": list(range(start, start + count))})
            start += count
        state = {
            j: {k: cut_like(v, params[name]) for k, v in saved["state"][index[name]].items()}
            for j, name in enumerate(self.own)
            if index[name] in saved["state"]
        }
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


class StageShards:
    """This stage's part of the model's state as DCP writes a sharded model's (the model's
    own names, this stage's DTensor shards): the stages together write the keys a plain FSDP
    run's checkpoint holds, and each loads its own part of either."""

    def __init__(self, pipeline: Stages) -> None:
        self.pipeline = pipeline

    def state_dict(self) -> dict[str, Any]:
        state = self.pipeline.model.state_dict()
        return {name: value for name, value in state.items() if self.pipeline.owns(name)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipeline.model.load_state_dict(state, strict=False)  # loaded in place already


class StageOptimizerShards:
    """This stage's optimizer state keyed by parameter name, as torch's
    ``get_optimizer_state_dict`` gives a plain FSDP run's, with the user's parameter groups
    naming every stage's parameters (the same on every rank, as that run's)."""

    def __init__(self, pipeline: Stages) -> None:
        self.pipeline = pipeline

    def state_dict(self) -> dict[str, Any]:
        from fastdist.strategies.sharded_io import optimizer_shards

        own = optimizer_shards(self.pipeline.model, self.pipeline.optimizer)
        groups = [
            {**group, "params": list(names)}
            for group, names in zip(own["param_groups"], self.pipeline.groups, strict=True)
        ]
        return {**own, "param_groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from fastdist.strategies.sharded_io import load_optimizer_shards

        owns = self.pipeline.owns
        groups = [
            {**group, "params": [name for name in group["params"] if owns(name)]}
            for group in state["param_groups"]
        ]
        own = {name: value for name, value in state["state"].items() if owns(name)}
        mine = {**state, "state": own, "param_groups": groups}
        load_optimizer_shards(self.pipeline.model, self.pipeline.optimizer, mine)
