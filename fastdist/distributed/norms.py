"""Norms of tensors that may be sharded (DTensors, possibly on several device meshes), the
same on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from fastdist.distributed.dtensor import is_dtensor


def by_mesh(tensors: Iterable[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """``tensors`` grouped by their device mesh (``None``: plain tensors). FSDP with tensor
    parallelism holds two: the split layers' 2-D mesh and its ``dp_shard`` dimension."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if is_dtensor(t) else None, []).append(t)
    return groups


def global_norm(tensors: Iterable[torch.Tensor], group: Any = None) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together as a plain tensor: each mesh's DTensors normed
    over the whole mesh (a collective on it), plain tensors locally. torch's
    ``get_total_norm`` takes one mesh only. ``group``: ranks holding other parts of the same
    tensors (a pipeline's stages), whose norms join this one (a collective on it)."""
    norms = []
    for part in by_mesh(tensors).values():
        norm = torch.nn.utils.get_total_norm(part)
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    if len(norms) == 1:
        total = norms[0]
    else:
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if group is None:
        return total
    squares = total.double().square()
    dist.all_reduce(squares, group=group)
    return squares.sqrt().to(total.dtype)
