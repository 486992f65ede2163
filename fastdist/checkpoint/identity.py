"""What a checkpoint was written for: the model (its state-dict entries and their shapes), the
optimizer's class and how many parameters each of its groups holds.

A resume compares them with this run's before it loads anything. Unchecked, another optimizer
class's state would load (an AdamW's into an ``Adam``, settings included, which then trains as
AdamW) or fail at the first step with a ``KeyError``, and another model's would fail deep in
torch or DCP without naming the checkpoint. Both are read
from the objects the user passed: the model's state-dict names stay its own under every
strategy, and a sharded or tensor-parallel parameter (a DTensor) reports its global shape, so
every layout and world size describes the same model alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy


def identity(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": {entry: shape}, "optimizer": class}`` of the run's own objects (shapes as
    ``(16, 4)``; a lazy parameter's as ``lazy``)."""
    shapes = {
        name: "lazy" if is_lazy(value) else str(tuple(value.shape))
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
    if saved["model"] != live["model"]:
        odd = differences(live["model"], saved["model"], "this model", "the checkpoint")
        return (
            f"checkpoint {path} was written for another model: {odd}. Pass model= the model it "
            f"was trained with, {fix}"
        )
    if saved.get("groups", live.get("groups")) != live.get("groups"):  # older: not recorded
        return (
            f"checkpoint {path} holds the state of an optimizer whose parameter groups hold "
            f"{saved['groups']} parameters, but this run's optimizer's hold {live['groups']}: "
            "build the optimizer over the same parameters as the run that wrote it (e.g. all "
            f"of the model's, frozen ones included: they keep no state), {fix}"
        )
    return None


def differences(mine: Mapping[str, str], theirs: Mapping[str, str], me: str, them: str) -> str:
    """Two models' state-dict entries (name -> its shape, or shape and dtype) ``mine`` against
    ``theirs`` in words (at most 5 entries), e.g. ``0.weight is (3, 4) torch.float32 in group 1
    and (1, 4) torch.float32 in group 0`` (a resume's refusal, torchft's replica groups)."""
    words = []
    for name in sorted(mine.keys() | theirs.keys()):
        if name not in theirs:
            words.append(f"{name} only in {me}")
        elif name not in mine:
            words.append(f"{name} only in {them}")
        elif mine[name] != theirs[name]:
            words.append(f"{name} is {mine[name]} in {me} and {theirs[name]} in {them}")
    more = f" (and {len(words) - 5} more)" if len(words) > 5 else ""
    return ", ".join(words[:5]) + more
