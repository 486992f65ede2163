"""Norms of tensors that may be sharded (DTensors, possibly on several device meshes), the
same on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fastdist.distributed.dtensor import is_dtensor


def by_mesh(tensors: Iterable[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """``tensors`` grouped by their device mesh (``None``: plain tensors). FSDP with tensor
    parallelism holds two: the split layers' 2-D mesh and its ``dp_shard`` dimension."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if is_dtensor(t) else None, []).append(t)
    return groups


def global_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together as a plain tensor: each mesh's DTensors normed
    over the whole mesh (a collective on it), plain tensors locally. torch's
    ``get_total_norm`` takes one mesh only."""
    norms = []
    for group in by_mesh(tensors).values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
