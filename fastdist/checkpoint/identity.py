"""What a checkpoint was written for: the model (its state-dict entries and their shapes) and
the optimizer's class.

A resume compares them with this run's before it loads anything. Unchecked, another optimizer
class's state would load (an AdamW's into an ``Adam``, settings included, which then trains as
AdamW) or fail at the first step with a ``KeyError``, and another model's would fail deep in
torch or DCP without naming the checkpoint. Both are read
from the objects the user passed: the model's state-dict names stay its own under every
strategy, and a sharded or tensor-parallel parameter (a DTensor) reports its global shape, so
every layout and world size describes the same model alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy


def identity(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": {entry: shape}, "optimizer": class}`` of the run's own objects (a lazy
    parameter's shape is ``None``)."""
    shapes = {
        name: None if is_lazy(value) else list(value.shape)
        for name, value in model.state_dict().items()
        if isinstance(value, torch.Tensor)
    }
    kind = None if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    return {"model": shapes, "optimizer": kind}


def refusal(saved: dict[str, Any] | None, live: dict[str, Any] | None, path: str) -> str | None:
    """Why checkpoint ``path``, written for ``saved``, cannot resume this run (``live``);
    ``None`` where it can, or where either is not known (a checkpoint older than the record)."""
    if saved is None or live is None:
        return None
    fix = "or start afresh (resume=False) in another save_path/checkpoint_dir"
    if saved["optimizer"] != live["optimizer"]:
        return (
            f"checkpoint {path} holds the state of a {saved['optimizer']} optimizer, but this "
            f"run passes optimizer={live['optimizer']}(...): pass a {saved['optimizer']}, {fix}, "
            f"from its weights alone if you like (python -m fastdist export {path} model.pt "
            "writes them for model.load_state_dict)"
        )
    there, here = saved["model"], live["model"]
    differences = [f"{name!r} is missing from this model" for name in there if name not in here]
    differences += [f"{name!r} is not in the checkpoint" for name in here if name not in there]
    differences += [
        f"{name!r} has shape {there[name]} there and {here[name]} here"
        for name in there
        if name in here and there[name] != here[name]
    ]
    if not differences:
        return None
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    return (
        f"checkpoint {path} was written for another model: {'; '.join(differences[:3])}{more}. "
        f"Pass model= the model it was trained with, {fix}"
    )
