"""Reading named fields (fastNLP's field mapping) from a model output and a batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def get_field(output: Any, batch: Any, name: str, from_batch: bool) -> torch.Tensor:
    """Read field ``name``: a prediction from the output, a target from the batch.

    A tensor output is the prediction whatever its name; a tuple batch ``(x, ..., y)`` has the
    target last. Dict lookups fall back to the other side, as fastNLP's field mapping did.
    """
    first, second = (batch, output) if from_batch else (output, batch)
    if not from_batch and isinstance(output, torch.Tensor):
        return output
    if from_batch and isinstance(batch, Sequence) and not isinstance(batch, str):
        return batch[-1]
    for source in (first, second):
        if isinstance(source, Mapping) and name in source:
            return source[name]
    keys = sorted(set(_keys(output)) | set(_keys(batch)))
    side = "target" if from_batch else "pred"
    raise KeyError(
        f"field {name!r} is neither in the model output nor in the batch; have {keys}: pass "
        f"the name to read as {side}=..., e.g. CrossEntropyLoss(pred='logits', "
        "target='labels'); loss=None takes the model's own 'loss'"
    )


def _keys(obj: Any) -> list[str]:
    return list(obj.keys()) if isinstance(obj, Mapping) else []
