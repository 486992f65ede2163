"""Gradient clipping, once per optimizer update, on the all-reduced gradients."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fastdist.callbacks.callback import Callback
from fastdist.distributed.norms import by_mesh, global_norm


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter], max_norm: float, stages: Any = None
) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most ``max_norm``; return the
    norm before. As torch's ``clip_grad_norm_``, for gradients on several device meshes too
    (FSDP with tensor parallelism): the norm is taken over every mesh, the scaling per mesh;
    ``stages``: the process group of a pipeline's stages, each holding its own gradients."""
    params = [p for p in parameters if p.grad is not None]
    total = global_norm((p.grad for p in params if p.grad is not None), stages)
    for group in by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


class GradientClipCallback(Callback):
    """Clip gradients by global norm or by value before each optimizer update.

    Put it in ``callbacks_all``. It runs after the window's last backward, when DDP has
    averaged the gradients, so every rank clips the same gradients the same way; under FSDP,
    tensor parallel too, by the global norm over every shard (:func:`clip_grad_norm`).

    Args:
        clip_value: the maximum norm (``clip_type="norm"``) or absolute value (``"value"``).
        clip_type: ``"norm"`` or ``"value"``.
        parameters: what to clip; default all of the model's parameters.

    Example:
        >>> clip = GradientClipCallback(clip_value=1.0, clip_type="norm")
    """

    changes_training = True

    def __init__(self, clip_value: float = 1.0, clip_type: str = "norm", parameters=None) -> None:
        if clip_type not in ("norm", "value"):
            raise ValueError(f"clip_type must be 'norm' or 'value', got {clip_type!r}")
        if clip_value <= 0:
            raise ValueError(f"clip_value must be > 0, got {clip_value}")
        self.clip_value = clip_value
        self.clip_type = clip_type
        self.parameters = None if parameters is None else list(parameters)

    def on_backward_end(self) -> None:
        if not self.trainer.state.is_update:
            return  # gradients are still partial inside an accumulation window
        self.trainer.precision.unscale_(self.trainer.optimizer)  # fp16: true scale first
        params = self.parameters or list(self.trainer.model.parameters())
        if self.clip_type == "norm":
            clip_grad_norm(params, self.clip_value, self.trainer.topology.stage_group)
        else:
            torch.nn.utils.clip_grad_value_(params, self.clip_value)
