"""FSDP: torch's ``fully_shard`` (FSDP2) per block, then on the root.

Each rank keeps only its shard of every parameter, gradient and optimizer state; a block's
parameters are all-gathered for its forward and backward, and gradients reduce-scattered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from fastdist.checkpoint import PER_RANK, SHARDED
from fastdist.checks import check_bool, describe
from fastdist.distributed import get_rank, get_world_size, is_distributed
from fastdist.logging import logger
from fastdist.strategies.base import Strategy
from fastdist.strategies.sharded_io import ShardedModel, ShardedOptimizer, gather_full, scatter_full

_PARAM_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def find_blocks(model: nn.Module, wrap: Sequence[type[nn.Module]] | None) -> list[str]:
    """Names of the submodules to shard one by one: instances of ``wrap``, or by default the
    children of every ``nn.ModuleList`` (transformer layers). Outermost matches only."""
    if wrap:
        wrap_types = tuple(wrap)
        names: list[str] = []
        for name, module in model.named_modules():
            inside = any(name.startswith(outer + ".") for outer in names)
            if name and isinstance(module, wrap_types) and not inside:
                names.append(name)
        return names
    return [
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        for child, _ in module.named_children()
    ]


def switch_parameters(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module
) -> None:
    """Point ``optimizer`` (its class, groups and hyperparameters kept; a learning-rate
    scheduler built on it stays valid) at the model's new parameters: ``fully_shard``
    replaces every ``Parameter``, and the optimizer would step the stale ones."""
    new = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [new[old_names[id(p)]] for p in group["params"]]


def check_wrap(wrap: Any) -> None:
    """``FSDP(wrap=...)``: ``None`` or a list of ``nn.Module`` subclasses."""
    if isinstance(wrap, type) and issubclass(wrap, nn.Module):
        name = wrap.__name__
        raise TypeError(f"wrap must be a list of nn.Module classes: pass a list, wrap=[{name}]")
    if wrap is None:
        return
    if not isinstance(wrap, (list, tuple)):
        raise TypeError(
            f"wrap must be a list of nn.Module classes (the model's blocks) or None, got "
            f"{describe(wrap)}"
        )
    for item in wrap:
        if not (isinstance(item, type) and issubclass(item, nn.Module)):
            hint = f": pass the class, {type(item).__name__}" if isinstance(item, nn.Module) else ""
            raise TypeError(
                f"wrap must hold nn.Module classes (the model's blocks), got {describe(item)}{hint}"
            )


class FSDP(Strategy):
    """Fully sharded data parallelism with torch's ``fully_shard`` (FSDP2).

    ``strategy="fsdp"`` is ``FSDP()``. The optimizer is pointed at the sharded parameters
    (same class, groups and hyperparameters). Checkpoints are sharded (DCP: every rank writes
    its shards, and any world size resumes them), also on one process, where the model runs
    as it is.

    Args:
        wrap: module classes sharded one by one (the repeated blocks); ``None``: the children
            of the model's ``nn.ModuleList``s. The root is sharded last, holding the rest.
        reshard_after_forward: free each block's gathered parameters after its forward (and
            gather again in backward): less memory, more communication. The root keeps its
            parameters gathered from forward to backward, which needs them first (torch's
            default for the root).
        cpu_offload: keep the parameter shards, gradients and optimizer state in host memory
            (``CPUOffloadPolicy``); the optimizer steps on the CPU. CUDA only.

    The trainer's ``amp`` sets the ``MixedPrecisionPolicy``: parameters cast to bf16/fp16 for
    compute, gradients reduced in fp32.

    Example:
        >>> DistTrainer(..., strategy=FSDP(wrap=[TransformerBlock]))
    """

    equal_forwards = True
    waits_in_compute = True

    def __init__(
        self,
        wrap: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
    ) -> None:
        check_wrap(wrap)
        check_bool("reshard_after_forward", reshard_after_forward)
        check_bool("cpu_offload", cpu_offload)
        self.wrap = wrap
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    def check(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        amp: str | None,
    ) -> None:
        if optimizer.state and get_world_size() > 1:
            raise ValueError(
                "FSDP needs an optimizer that has not stepped yet (its state is keyed by the "
                "parameters fully_shard replaces): build it just before DistTrainer"
            )
        present = {type(m) for m in model.modules()}
        absent = [cls.__name__ for cls in self.wrap or () if cls not in present]
        if absent:
            raise ValueError(
                f"FSDP(wrap=...) names {absent}, which the model does not contain: pass the "
                "classes of its repeated blocks (e.g. its transformer layer class), or None to "
                "shard the children of its nn.ModuleLists"
            )
        if self.cpu_offload and device.type != "cuda":
            raise ValueError(
                "FSDP(cpu_offload=True) moves sharded state from the GPU to host memory; on a "
                "CPU device it already lives there: drop cpu_offload"
            )

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        group: Any,
        amp: str | None,
    ) -> torch.optim.Optimizer:
        super().setup(model, optimizer, device, group, amp)
        if not is_distributed():
            logger.info("strategy FSDP on one process: the plain model, nothing to shard")
            return optimizer
        old_names = {id(p): name for name, p in model.named_parameters()}
        group = group or dist.group.WORLD
        assert group is not None  # several processes: the default group exists
        mesh = DeviceMesh.from_group(group, device.type)
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=_PARAM_DTYPES[amp], reduce_dtype=torch.float32 if amp else None
            ),
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }
        blocks = find_blocks(model, self.wrap)
        for name in blocks:
            fully_shard(model.get_submodule(name), **options)
        # Resharding the root after forward would gather its parameters again at once in
        # backward: one more all-gather per micro-batch, ~1 ms per update on a small CPU model.
        fully_shard(model, **{**options, "reshard_after_forward": False})
        if callable(getattr(model, "predict", None)):  # evaluation calls it: gather there too
            register_fsdp_forward_method(model, "predict")
        logger.info(
            "fsdp: sharded %d block(s) one by one%s, then the root %s",
            len(blocks),
            f" ({blocks[0]} ... {blocks[-1]})" if blocks else "",
            type(model).__name__,
        )
        switch_parameters(optimizer, old_names, model)
        return optimizer

    def replicas(self, step: int) -> list[tuple[str, torch.Tensor]]:
        """None when sharded: each parameter has one copy, split over the ranks."""
        return [] if isinstance(self.model, FSDPModule) else super().replicas(step)

    def after_evaluation(self) -> None:
        """Shard the root's parameters again: a forward without backward leaves them gathered
        (the root keeps them for backward), beside the sharded blocks'."""
        if isinstance(self.model, FSDPModule):
            self.model.reshard()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate unreduced; the window's last micro-batch reduce-scatters them."""
        if not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def full_state_dict(self) -> dict[str, Any] | None:
        """The whole model's ``state_dict`` on the CPU of rank 0 (a collective)."""
        if not isinstance(self.model, FSDPModule):  # one process: the plain model
            return super().full_state_dict()
        return gather_full(self.model, get_rank())

    def load_full_state_dict(self, weights: dict[str, Any] | None) -> None:
        """Load rank 0's full ``weights`` into every rank's shards (a collective)."""
        if not isinstance(self.model, FSDPModule):
            super().load_full_state_dict(weights)
            return
        scatter_full(self.model, weights)

    def checkpoint_parts(self) -> list[tuple[str, Any, str]]:
        """Model and optimizer as DCP shards (any world size resumes them)."""
        return [
            ("model", ShardedModel(self.model), SHARDED),
            ("optimizer", ShardedOptimizer(self.model, self.optimizer), SHARDED),
            ("strategy", self, PER_RANK),
        ]
