"""Reading checkpoints of format 1 (fastdist before named parts) as format 2.

Format 1 was one flat dict: ``model``, ``optimizer`` (absent when sharded: they were in the DCP
shards under the same names), ``trainer``, ``precision``, ``callbacks_all`` and
``callbacks_master`` (lists, by position), ``ddp`` (rank 0's communication-hook state),
``best_model_path``, ``world_size``, ``seed``, and the per-rank lists ``rng`` and ``data``.
"""

from __future__ import annotations

from typing import Any

from fastdist.logging import logger


def upgrade(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` in format 2 (as it is if it already is)."""
    if checkpoint.get("format") != 1:
        return checkpoint
    world = checkpoint["world_size"]
    hook = dict(checkpoint["ddp"])
    if hook.pop("powersgd", None) is not None:
        logger.warning(
            "this checkpoint (format 1) holds rank 0's PowerSGD state only, which cannot "
            "continue exactly on every rank: PowerSGD's error feedback restarts"
        )
    parts: dict[str, Any] = {
        "trainer": checkpoint["trainer"],
        "precision": checkpoint["precision"],
        "callbacks": {"all": checkpoint["callbacks_all"], "master": checkpoint["callbacks_master"]},
        "best_model": {"path": checkpoint["best_model_path"]},
    }
    per_rank = {"rng": checkpoint["rng"], "data": checkpoint["data"], "strategy": [hook] * world}
    sharded = "model" not in checkpoint
    if not sharded and "local_sgd_iter" in hook:  # local SGD: rank 0's copy, on every rank
        for name in ("model", "optimizer"):
            per_rank[name] = [checkpoint[name]] * world
    elif not sharded:
        parts.update(model=checkpoint["model"], optimizer=checkpoint["optimizer"])
    return {
        "format": 2,
        "world_size": world,
        "parts": parts,
        "per_rank": per_rank,
        "sharded": ["model", "optimizer"] if sharded else [],
    }
