"""The DDP strategy: torch's DistributedDataParallel, communication hooks, post-local SGD."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel

from fastdist.strategies.base import Strategy
from fastdist.trainer.checkpoint import decode_numpy_state, encode_numpy_state


class DDPStrategy(Strategy):
    """Every rank holds the whole model; DDP all-reduces the gradients of each update.

    Args:
        device: this rank's device.
        group: the process group of the gradient all-reduce.
        comm_hook: ``None`` (plain all-reduce), ``"fp16"``/``"bf16"`` (gradients compressed to
            half precision for the all-reduce) or ``"powersgd"`` (low-rank compression, rank 1,
            after 10 plain updates; its error-feedback state is checkpointed).
        average_every: post-local SGD: after ``average_every`` warm-up updates with plain
            all-reduce, each rank steps on its own gradients and the parameters are averaged
            (torch's ``average_parameters``) after every update whose number is a multiple of
            ``average_every``. ``0``: off.
        ddp_options: passed to ``DistributedDataParallel`` (``find_unused_parameters``,
            ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``).
    """

    name = "ddp"

    def __init__(
        self,
        device: torch.device,
        group: Any = None,
        comm_hook: str | None = None,
        average_every: int = 0,
        **ddp_options: Any,
    ) -> None:
        super().__init__(device, group)
        self.comm_hook = comm_hook
        self.average_every = average_every
        self.ddp_options = ddp_options
        self.hook_state: Any = None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        device, group = self.device, self.group
        self.module = ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group,
            **self.ddp_options,
        )
        if self.comm_hook in ("fp16", "bf16"):
            hook = default_hooks.fp16_compress_hook
            if self.comm_hook == "bf16":
                hook = default_hooks.bf16_compress_hook
            ddp.register_comm_hook(group, hook)
        elif self.comm_hook == "powersgd":
            self.hook_state = powerSGD_hook.PowerSGDState(
                process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=10
            )
            ddp.register_comm_hook(self.hook_state, powerSGD_hook.powerSGD_hook)
        if self.average_every:
            # Each rank its own subgroup: after the warm-up no gradient is all-reduced at all.
            subgroup, _ = dist.new_subgroups(group_size=1)
            self.hook_state = post_localSGD_hook.PostLocalSGDState(
                process_group=group, subgroup=subgroup, start_localSGD_iter=self.average_every
            )
            ddp.register_comm_hook(self.hook_state, post_localSGD_hook.post_localSGD_hook)
        return optimizer

    def no_sync(self) -> contextlib.AbstractContextManager:
        assert isinstance(self.module, DistributedDataParallel)
        return self.module.no_sync()

    def after_step(self, model: nn.Module, step: int) -> None:
        """After update ``step``: average the parameters if the local-SGD period ends here."""
        every = self.average_every
        if every and step > every and step % every == 0:
            group = self.group or dist.group.WORLD  # WORLD exists: DDP runs in a group
            average_parameters(model.parameters(), group)  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """Hook progress (PowerSGD's error feedback), as tensors and plain data."""
        state: dict[str, Any] = {}
        if isinstance(self.hook_state, powerSGD_hook.PowerSGDState):
            s = self.hook_state
            state["powersgd"] = {
                "iter": s.iter,
                "error_dict": dict(s.error_dict),
                "p_memory_dict": dict(s.p_memory_dict),
                "q_memory_dict": dict(s.q_memory_dict),
                "rng": encode_numpy_state(s.rng.get_state(legacy=True)),
            }
        if isinstance(self.hook_state, post_localSGD_hook.PostLocalSGDState):
            state["local_sgd_iter"] = self.hook_state.iter
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "powersgd" in state and isinstance(self.hook_state, powerSGD_hook.PowerSGDState):
            saved, s = state["powersgd"], self.hook_state
            s.iter = saved["iter"]
            s.error_dict.update(saved["error_dict"])
            s.p_memory_dict.update(saved["p_memory_dict"])
            s.q_memory_dict.update(saved["q_memory_dict"])
            s.rng.set_state(decode_numpy_state(saved["rng"]))
        if "local_sgd_iter" in state:
            self.hook_state.iter = state["local_sgd_iter"]
