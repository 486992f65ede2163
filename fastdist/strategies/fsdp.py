"""The FSDP strategy: torch's ``fully_shard`` (FSDP2) per block, then on the root.

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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from fastdist.logging import logger
from fastdist.strategies.base import Strategy

_PARAM_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


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


def check_fsdp_wrap(model: nn.Module, wrap: Sequence[type[nn.Module]] | None) -> None:
    """Refuse ``fsdp_wrap`` classes the model does not contain (on every rank, no collective)."""
    if not wrap:
        return
    present = {type(m) for m in model.modules()}
    absent = [cls.__name__ for cls in wrap if cls not in present]
    if absent:
        raise ValueError(
            f"fsdp_wrap names {absent}, which the model does not contain: pass the classes of "
            "its repeated blocks (e.g. its transformer layer class), or None to shard the "
            "children of its nn.ModuleLists"
        )


def switch_parameters(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module
) -> None:
    """Point ``optimizer`` (its class, groups and hyperparameters kept; a learning-rate
    scheduler built on it stays valid) at the model's new parameters: ``fully_shard``
    replaces every ``Parameter``, and the optimizer would step the stale ones."""
    if optimizer.state:
        raise ValueError(
            "strategy='fsdp' needs an optimizer that has not stepped yet (its state is keyed "
            "by the parameters fully_shard replaces): build it just before DistTrainer"
        )
    new = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [new[old_names[id(p)]] for p in group["params"]]


class FSDPStrategy(Strategy):
    """Fully sharded data parallelism with torch's ``fully_shard`` (FSDP2).

    Args:
        device: this rank's device.
        group: the process group to shard over (``None``: the default group).
        wrap: module classes sharded one by one (the repeated blocks); ``None``: the children
            of the model's ``nn.ModuleList``s. The root is sharded last, holding the rest.
        reshard_after_forward: free each block's gathered parameters after its forward (and
            gather again in backward): less memory, more communication.
        amp: ``"bf16"``/``"fp16"``: parameters cast to that dtype for compute, gradients
            reduced in fp32 (``MixedPrecisionPolicy``); ``None``: fp32.
        cpu_offload: keep the parameter shards, gradients and optimizer state in host
            memory (``CPUOffloadPolicy``); the optimizer steps on the CPU.
    """

    name = "fsdp"

    def __init__(
        self,
        device: torch.device,
        group: Any = None,
        wrap: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        amp: str | None = None,
        cpu_offload: bool = False,
    ) -> None:
        super().__init__(device, group)
        self.wrap_classes = wrap
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = MixedPrecisionPolicy(
            param_dtype=_PARAM_DTYPES[amp], reduce_dtype=torch.float32 if amp else None
        )
        self.offload_policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        old_names = {id(p): name for name, p in model.named_parameters()}
        group = self.group or dist.group.WORLD
        assert group is not None  # FSDP runs on several processes only
        mesh = DeviceMesh.from_group(group, self.device.type)
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self.mp_policy,
            "offload_policy": self.offload_policy,
        }
        blocks = find_blocks(model, self.wrap_classes)
        for name in blocks:
            fully_shard(model.get_submodule(name), **options)
        fully_shard(model, **options)
        logger.info(
            "fsdp: sharded %d block(s) one by one%s, then the root %s",
            len(blocks),
            f" ({blocks[0]} ... {blocks[-1]})" if blocks else "",
            type(model).__name__,
        )
        self.module = model
        switch_parameters(optimizer, old_names, model)
        return optimizer

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate unreduced; the window's last micro-batch reduce-scatters them."""
        assert isinstance(self.module, FSDPModule)
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any] | None:
        """The whole model's ``state_dict`` on the CPU of rank 0 (a collective)."""
        weights = get_model_state_dict(model, options=_FULL)
        return weights if dist.get_rank(self.group) == 0 else None

    def load_full_state_dict(self, model: nn.Module, weights: dict[str, Any] | None) -> None:
        """Load rank 0's full ``weights`` into every rank's shards (a collective)."""
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, weights or {}, options=options)
