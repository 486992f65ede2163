"""Whether a checkpoint's content will load back: checkpoints load with
``torch.load(weights_only=True)``, which refuses objects other than tensors, numbers,
strings and containers of them (a ``pathlib.Path``, a NumPy scalar, a ``datetime``...). A
state that holds one would be written, then skipped on every resume."""

from __future__ import annotations

import io
import re
from typing import Any

import torch
from torch.utils._pytree import tree_map

_NO_DATA = torch.empty(0)


def unloadable(content: Any, where: str = "") -> str | None:
    """Where in ``content`` (a checkpoint's dict) is something ``torch.save`` or
    ``torch.load(weights_only=True)`` refuses, and why, in one line; ``None`` if nothing is.
    Tensors are checked as empty ones: only the structure around them is written here."""
    problem = _round_trip(content)
    if problem is None:
        return None
    if isinstance(content, dict):  # name the innermost entry that fails
        for key, value in content.items():
            inner = unloadable(value, f"{where}[{key!r}]")
            if inner is not None:
                return inner
    return (
        f"a checkpoint cannot hold {where or 'the state'}: {problem}; checkpoints load with "
        "torch.load(weights_only=True), which takes tensors, numbers, strings, lists and dicts: "
        "return those from state_dict() (e.g. str(path), float(x))"
    )


def _round_trip(value: Any) -> str | None:
    skeleton = tree_map(lambda v: _NO_DATA if isinstance(v, torch.Tensor) else v, value)
    buffer = io.BytesIO()
    try:
        torch.save(skeleton, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        return _reason(exc)
    return None


def _reason(exc: Exception) -> str:
    """The line of ``exc``'s message that says what was refused (torch's weights-only error
    is several paragraphs: "Unsupported global: GLOBAL pathlib.PosixPath ...")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if found:
        return f"{found.group(1)} is not a type weights_only loading takes"
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
