"""Wrapping the model in DDP, with torch's communication hooks and periodic model averaging."""

from __future__ import annotations

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

from fastdist.trainer.checkpoint import decode_numpy_state, encode_numpy_state

COMM_HOOKS = ("fp16", "bf16", "powersgd")


class DDPWrapper:
    """Builds the DDP module and owns what is attached to it (hook state, averaging period).

    Args:
        comm_hook: ``None`` (plain all-reduce), ``"fp16"``/``"bf16"`` (gradients compressed to
            half precision for the all-reduce) or ``"powersgd"`` (low-rank compression, rank 1,
            after 10 plain updates; its error-feedback state is checkpointed).
        average_every: post-local SGD: after ``average_every`` warm-up updates with plain
            all-reduce, each rank steps on its own gradients and the parameters are averaged
            (torch's ``average_parameters``) after every update whose number is a multiple of
            ``average_every``. ``0``: off.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        group: Any,
        comm_hook: str | None = None,
        average_every: int = 0,
        **ddp_options: Any,
    ) -> None:
        self.module = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group,
            **ddp_options,
        )
        self.hook_state: Any = None
        self.group = group
        self.average_every = average_every
        if comm_hook in ("fp16", "bf16"):
            hook = default_hooks.fp16_compress_hook
            if comm_hook == "bf16":
                hook = default_hooks.bf16_compress_hook
            self.module.register_comm_hook(group, hook)
        elif comm_hook == "powersgd":
            self.hook_state = powerSGD_hook.PowerSGDState(
                process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=10
            )
            self.module.register_comm_hook(self.hook_state, powerSGD_hook.powerSGD_hook)
        if average_every:
            # Each rank its own subgroup: after the warm-up no gradient is all-reduced at all.
            subgroup, _ = dist.new_subgroups(group_size=1)
            self.hook_state = post_localSGD_hook.PostLocalSGDState(
                process_group=group, subgroup=subgroup, start_localSGD_iter=average_every
            )
            self.module.register_comm_hook(self.hook_state, post_localSGD_hook.post_localSGD_hook)

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
