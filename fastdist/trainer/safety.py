"""Cross-rank checks that turn silent divergence or hangs into errors, the same on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from fastdist.distributed import all_gather_object
from fastdist.distributed.dtensor import is_dtensor, piece
from fastdist.distributed.norms import global_norm
from fastdist.logging import logger
from fastdist.state import TrainerState

if TYPE_CHECKING:
    from fastdist.strategies import Strategy


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


def check_in_sync(strategy: Strategy, step: int, every: int | None, at_end: bool) -> None:
    """Where ``check_sync_every`` (``every``) asks: after every N-th update and at the end
    (``at_end``: after the last update), or, ``None``, at the end only, and there across
    torchft's replica groups only where N asks: compare a checksum of each tensor the ranks
    hold copies of after update ``step`` (:meth:`~fastdist.strategies.Strategy.replicas`)
    across the ranks that hold the same piece of it (a plain tensor: the whole; a DTensor:
    the same coordinates along the mesh dimensions it is split over, so tensor parallel's
    replicated parameters and HSDP's shards are compared too); raise on every rank on the
    first that differs. Nothing to compare (FSDP: one copy of each parameter, or one
    process): no collective."""
    if every is None:
        due = at_end and strategy.replica_group[1] == 1
    else:
        due = every > 0 and (at_end or step % every == 0)
    if not due:
        return
    replicas = strategy.replicas(step)
    if not replicas or strategy.topology.world_size == 1:
        return
    local = ((name, t.to_local() if is_dtensor(t) else t) for name, t in replicas)
    sums = {name: float(t.detach().sum(dtype=torch.float64)) for name, t in local}
    pieces = {name: piece(t) for name, t in replicas}
    everyone = all_gather_object((pieces, sums), strategy.group)  # a stage: its own names
    copies: dict[tuple[str, Any], dict[int, float]] = {}  # (name, piece): checksum by rank
    for rank, (their_pieces, their_sums) in enumerate(everyone):
        for name, value in their_sums.items():
            copies.setdefault((name, their_pieces[name]), {})[rank] = value
    for (name, _), values in copies.items():
        if len({repr(v) for v in values.values()}) > 1:  # NaN on every rank: the same
            raise RuntimeError(
                f"parameter {name!r} differs across ranks at step {step} (checksums by rank: "
                f"{values}): code running on some ranks only (in callbacks_master, or behind a "
                "rank test) changed the model or how it trains (e.g. the learning rate), or "
                "requires_grad changed during an epoch, which DDP does not follow; make the "
                "change on every rank, in callbacks_all"
            )


class TrainableCheck:
    """The names of ``model``'s parameters that train (``requires_grad``) when the trainer
    is built, where the strategy fixed them (``fixed``: DDP all-reduces those only)."""

    def __init__(self, model: torch.nn.Module, fixed: bool) -> None:
        self.model = model
        self.names = self._names() if fixed else None

    def _names(self) -> list[str]:
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def check(self) -> None:
        """Raise if the parameters that train changed (alike on every rank that changed them:
        a callback in ``callbacks_all``)."""
        if self.names is None or (now := self._names()) == self.names:
            return
        unfrozen, frozen = sorted(set(now) - set(self.names)), sorted(set(self.names) - set(now))
        raise ValueError(
            f"requires_grad changed after DistTrainer was built (unfrozen: {unfrozen[:3]}, "
            f"frozen: {frozen[:3]}): torch's DDP all-reduces the gradients of the parameters "
            "that trained when it wrapped the model only, so the ranks would train the "
            "others apart, or wait for gradients that never come. Set requires_grad before "
            "building DistTrainer (to change it later, build a new one on the same save_path: "
            "it resumes from the last checkpoint)"
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
