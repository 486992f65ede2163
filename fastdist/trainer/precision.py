"""Mixed precision: autocast for the forward pass, a gradient scaler for fp16 on CUDA."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The context of a forward in fp32: nothing, made once (it is entered twice per micro-batch).
FP32 = contextlib.nullcontext()


class Precision:
    """``amp=None`` (fp32), ``"bf16"`` (autocast, CPU or GPU) or ``"fp16"`` (autocast with a
    ``GradScaler``; CUDA only). A no-op in fp32, so the loop calls it unconditionally.
    """

    def __init__(self, amp: str | None, device: torch.device) -> None:
        if amp is not None and amp not in _DTYPES:
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
        if amp == "fp16" and device.type != "cuda":
            raise ValueError("amp='fp16' needs a CUDA device (a GradScaler); use amp='bf16' on CPU")
        self.amp = amp
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
        self.skipped_by_scaler = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass and the loss run in."""
        if self.amp is None:
            return FP32
        return torch.autocast(self.device_type, dtype=_DTYPES[self.amp])

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as ``backward()`` is called on it: times the gradient scaler's scale."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the gradients back to their true scale (before clipping); once per update."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; return False when fp16 overflow made the scaler skip it."""
        if self.scaler is None:  # False: a fault-tolerant update torchft did not commit
            return optimizer.step() is not False
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < scale:  # inf/NaN gradients: the scaler skipped the step
            self.skipped_by_scaler += 1
            return False
        return True

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
