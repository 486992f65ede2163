"""``DistTrainer.save_model``: the whole model in one file or a Hugging Face folder, from any
strategy, called on every rank."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fastdist.checkpoint.export import check_format, check_path, check_target, write_model
from fastdist.distributed import broadcast_object, get_rank
from fastdist.distributed.position import enter_on_every_rank
from fastdist.strategies import Strategy


def save_model(
    strategy: Strategy, path: str | os.PathLike, format: str, group: Any, timeout: float | None
) -> str:
    """Gather the whole model where it is sharded; rank 0 writes it to ``path`` atomically.

    Bad arguments raise alike on every rank before any collective, and so does a call some
    rank does not make (at once where that rank's script ended, else after ``timeout``
    seconds); a ``path`` rank 0 cannot write to raises on every rank before the weights are
    gathered, and so does a failed write after. Return ``path`` as a ``str``.
    """
    path = check_path(path)
    check_format("format", format, strategy.model)
    enter_on_every_rank("save_model", timeout)
    _on_rank_zero(lambda: check_target("path", path, format), group)
    strategy.before_evaluation()  # one model: e.g. local SGD's ranks averaged, as evaluated
    weights = strategy.full_state_dict()  # on rank 0; a collective where sharded
    _on_rank_zero(lambda: write_model(weights or {}, path, format, strategy.model), group)
    return path


def _on_rank_zero(action: Callable[[], None], group: Any) -> None:
    """Run ``action`` on rank 0; if it raises, raise on every rank (rank 0 its own error,
    the others one that quotes it), so that no rank waits for another."""
    failure: Exception | None = None
    error = None
    if get_rank() == 0:
        try:
            action()
        except Exception as exc:
            failure, error = exc, f"{type(exc).__name__}: {exc}"
    error = broadcast_object(error, group=group)
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"save_model failed on rank 0: {error}")
