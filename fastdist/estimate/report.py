"""Memory estimates as a table, and byte counts written for people (``80GB``, ``512MiB``)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from fastdist.estimate.memory import MemoryEstimate

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

#: The table's rows: label, and the estimate's field.
ROWS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer state", "optimizer"),
    ("activations", "activations"),
    ("gathered (FSDP)", "in_flight"),
)


def parse_bytes(text: str) -> int:
    """``"80GB"`` (powers of 10), ``"80GiB"`` (powers of 2) or a plain number, as bytes."""
    if text.strip().startswith("-"):
        raise ValueError(f"memory must be a positive size such as 80GB or 24GiB; got {text!r}")
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(
            f"memory must be a size such as 80GB, 80GiB, 512MB or a number of bytes; got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def format_bytes(n: int) -> str:
    """``n`` bytes in GB, MB or kB (powers of 10), three significant digits."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def table(estimates: Sequence[MemoryEstimate], budget: int | None = None) -> str:
    """One column per estimate: the bytes of one rank by kind, the peak, and (with a
    ``budget`` in bytes) the largest ``batch_size_per_gpu`` that fits it."""
    first = estimates[0]
    header = ["per rank", *(e.strategy for e in estimates)]
    lines = [header]
    for label, field in ROWS:
        lines.append([label, *(format_bytes(getattr(e, field)) for e in estimates)])
    lines.append(["peak", *(format_bytes(e.peak) for e in estimates)])
    if budget is not None:
        fits = [str(e.max_batch_size(budget)) for e in estimates]
        lines.append([f"max batch in {format_bytes(budget)}", *fits])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    body = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in lines
    ]
    title = (
        f"world size {first.world_size}, batch_size_per_gpu {first.batch_size}, "
        f"update_every {first.update_every}"
    )
    return "\n".join([title, *body])
