"""Ranks inside a Ray Train worker, from Ray's context.

``ray.train.torch.TorchTrainer`` forms the process group before the training function runs;
fastdist uses that group (``init_distributed`` returns early when one exists) and reads the
ranks that are not the group's (local rank, node rank, processes per node) from
``ray.train.get_context()``. Ray Train v2 also exports them as environment variables, without
torchrun's ``GROUP_RANK``; v1 exports none.

Ray is never imported here: a process is a Ray Train worker only if Ray Train is imported
already (the worker that runs the training function imports it).
"""

from __future__ import annotations

import sys
from typing import Any


def ray_train_context() -> Any | None:
    """Ray Train's context when this process runs a Ray Train training function, else None."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        return train.get_context()
    except Exception:  # Ray imported, but not in a training function (a driver, a Tune trial)
        return None


def torchrun_env_from_ray(context: Any) -> dict[str, str]:
    """The torchrun variables Ray Train's ``context`` implies (``GROUP_RANK``: Ray's node rank)."""
    return {
        "RANK": str(context.get_world_rank()),
        "WORLD_SIZE": str(context.get_world_size()),
        "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "GROUP_RANK": str(context.get_node_rank()),
    }


def in_ray_train() -> bool:
    """Whether this process runs a Ray Train training function."""
    return ray_train_context() is not None
