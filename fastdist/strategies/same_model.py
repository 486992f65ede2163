"""Replica groups must train one model: compare the groups' models by parameter names,
shapes and dtypes (:mod:`~fastdist.strategies.replica_groups` asks at every new quorum), and
their parameters (``check_sync_every``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ReduceOp

from fastdist.checkpoint.identity import differences

Signature = dict[str, str]  # name -> "shape dtype" of every entry of a model's state_dict

#: The entry of a group's signature that holds its number of processes: torchft pairs the
#: groups' ranks one to one, so every group must have as many.
PROCESSES = "(processes in the group)"

#: The entry of a group's signature that names its frozen parameters (``requires_grad``).
FROZEN = "(frozen parameters)"

FIX = (
    "every replica group must build the same model (the same parameter names, shapes, "
    "dtypes and frozen parameters): fix the script or its arguments so that all groups "
    "build one model, then restart every group"
)


def signature(state: Mapping[str, Any]) -> Signature:
    """The names, shapes and dtypes of a model's ``state_dict``."""
    return {name: f"{tuple(t.shape)} {t.dtype}" for name, t in state.items()}


def frozen_parameters(model: torch.nn.Module) -> str:
    """The names of ``model``'s parameters that train nothing (``requires_grad=False``): a
    few, their count and a digest; ``"none"``."""
    names = [name for name, p in model.named_parameters() if not p.requires_grad]
    if not names:
        return "none"
    digest = hashlib.sha1(repr(names).encode()).hexdigest()[:8]
    return f"{len(names)} {names[:2]}{'...' if len(names) > 2 else ''} #{digest}"


def check_same(manager: Any, index: int, mine: Signature) -> bool:
    """Compare this group's model (``index``, ``mine``) with every group's in torchft's
    quorum (collectives of ``manager``): raise the same ``ValueError`` on every group if
    they differ. Return ``False`` if a collective failed (the Manager records it)."""
    payload = json.dumps([index, mine], sort_keys=True).encode()
    same, longest = agree(manager, json.dumps(mine, sort_keys=True), len(payload))
    if same is not False:
        return bool(same)
    # They differ: every group's payload, each in its row, so all name the same groups.
    rows = torch.zeros(manager.num_participants(), longest, dtype=torch.uint8)
    rows[manager.participating_rank(), : len(payload)] = torch.frombuffer(
        bytearray(payload), dtype=torch.uint8
    )
    manager.allreduce(rows, reduce_op=ReduceOp.SUM).wait()
    if manager.errored():
        return False
    groups = dict(json.loads(bytes(row).rstrip(b"\0")) for row in rows.tolist())
    first, *others = sorted(groups)
    sizes = {g: groups[g].pop(PROCESSES, "?") for g in groups}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            "replica groups have different numbers of processes ("
            + ", ".join(f"group {g}: {n}" for g, n in sorted(sizes.items()))
            + "): torchft pairs each rank with the same rank of every other group; launch "
            "every group with the same number of processes (python -m fastdist ft "
            "--procs-per-group N), then restart every group"
        )
    odd = [
        differences(groups[g], groups[first], f"group {g}", f"group {first}")
        for g in others
        if groups[g] != groups[first]
    ]
    raise ValueError(f"replica groups build different models: {'; '.join(odd)}: {FIX}")


def agree(manager: Any, text: str, size: int = 0) -> tuple[bool | None, int]:
    """Whether every group in torchft's quorum holds the same ``text`` (one all-reduce of a
    digest; ``None`` if it failed, as the Manager records), and the largest ``size``."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
    top = torch.tensor([digest, -digest, size], dtype=torch.int64)
    manager.allreduce(top, reduce_op=ReduceOp.MAX).wait()
    if manager.errored():
        return None, 0
    return int(top[0]) == -int(top[1]), int(top[2])
