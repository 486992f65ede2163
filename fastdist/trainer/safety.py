"""Cross-rank checks that turn silent divergence or hangs into errors, the same on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fastdist.distributed import all_gather_object
from fastdist.distributed.norms import global_norm
from fastdist.logging import logger
from fastdist.state import TrainerState


def all_finite(tensors: Iterable[torch.Tensor | None], group: Any = None) -> bool:
    """Whether every value of ``tensors`` (``None`` entries skipped; DTensors judged over their
    whole mesh, alike on every rank) is finite; one host read. ``group``: a pipeline's stages,
    which judge their parts together."""
    present = [t for t in tensors if t is not None]
    if not present and group is None:
        return True
    return bool(torch.isfinite(global_norm(present, group)).item())


def failing_ranks(failure: Any, group: Any) -> dict[int, Any]:
    """Gather every rank's ``failure`` (``None``: none); the ranks that had one (a collective)."""
    everyone = all_gather_object(failure, group)
    return {rank: found for rank, found in enumerate(everyone) if found is not None}


def check_in_sync(
    replicas: list[tuple[str, torch.Tensor]], step: int, group: Any, copies: list[list[int]]
) -> None:
    """Compare a checksum of every replicated tensor (``(name, tensor)``, the same names within
    each group of ``copies``: :meth:`~fastdist.strategies.Strategy.replicas`,
    :attr:`~fastdist.strategies.Topology.copies`) across ranks; raise on every rank on the
    first that differs. Nothing to compare (FSDP: one copy of each parameter): no collective."""
    if not replicas:
        return
    sums = {name: float(t.detach().double().sum()) for name, t in replicas}
    everyone = all_gather_object(sums, group)  # a pipeline's stages: each its own tensors
    for ranks, name in ((r, n) for r in copies for n in everyone[r[0]]):
        values = {rank: everyone[rank].get(name) for rank in ranks}
        if len(set(values.values())) > 1:
            raise RuntimeError(
                f"parameter {name!r} differs across ranks at step {step} (checksums by rank: "
                f"{values}): code running on some ranks only (e.g. in callbacks_master) changed "
                "the model; change it in callbacks_all instead"
            )


def check_even_shards(n_batches: int, group: Any) -> None:
    """Ranks with different numbers of batches would hang in DDP: refuse before training."""
    counts = all_gather_object(n_batches, group)
    if len(set(counts)) > 1:
        raise ValueError(
            f"the training sampler gives the ranks different numbers of batches per epoch "
            f"({counts}, by rank): DDP would hang when one rank runs out. Use the default "
            "sampler (sampler=None) or make every rank's shard the same size"
        )


def warn_skipped(window_loss: torch.Tensor, state: TrainerState, group: Any) -> None:
    """Warn that this update is skipped on every rank, naming the ranks whose loss
    (``window_loss``, the update's) is NaN/Inf (a collective)."""
    finite = bool(torch.isfinite(window_loss))
    culprits = list(failing_ranks(None if finite else True, group))
    logger.warning(
        "non-finite loss or gradient at epoch %d update %d; ranks with a non-finite loss: "
        "%s: skipping this update on every rank",
        state.epoch,
        state.global_step + 1,
        culprits,
    )
