"""Replica groups under torchft (``DDP(fault_tolerant=True)``, ``FSDP(fault_tolerant=True)``):
per-step fault tolerance.

Each replica group is a job of its own (one torchrun, of one or more processes) that joins a
torchft Lighthouse. Every update starts with a torchft quorum
(:meth:`ReplicaGroups.start_update`), its gradients are averaged within the group by torch
and across the groups in the quorum over torchft's ``ProcessGroupGloo``
(:mod:`~fastdist.strategies.ft_comm`), and it is applied only where torchft's
``should_commit`` agrees (:class:`~fastdist.strategies.fault_tolerant.Gated`). A group that
joins behind the others receives every checkpoint part of a healthy group through torchft's
checkpoint transport, each rank from the same rank of the healthy group (its own shard,
under FSDP): the same ``state_dict`` contract as a checkpoint on disk; nothing is read from
disk. It heals only at its start (:meth:`ReplicaGroups.join`), where the trainer takes up
the peer's position; found behind later, or restarted with no live peer, it stops with an
error rather than train the job from the wrong place.

The launch says which group a process belongs to: ``FASTDIST_REPLICA_GROUP`` (its index, from
0), ``FASTDIST_REPLICA_GROUPS`` (how many the job has) and ``TORCHFT_LIGHTHOUSE`` (the
Lighthouse's URL); ``python -m fastdist ft`` sets them.

Accounting: an update's samples count when it is committed. Every replica group trains its
own shard of each epoch, slot by slot; a slot whose update a group did not commit (it was
dead, healing, or the update failed) is not trained again: that group's samples of the slot
(its real ones: a short last batch counts its samples, a filler none) are counted as lost in
``TrainerState.lost_samples`` (per epoch), logged at the epoch's end.
"""

from __future__ import annotations

import os
import socket
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn
from torch.utils.data import IterableDataset

from fastdist.distributed import all_gather_object, get_rank, get_world_size
from fastdist.distributed.dtensor import local_shards
from fastdist.logging import logger
from fastdist.state import TrainerState
from fastdist.strategies.ft_comm import group_store
from fastdist.strategies.same_model import (
    FIX,
    FROZEN,
    PROCESSES,
    Signature,
    agree,
    check_same,
    differences,
    frozen_parameters,
    signature,
)
from fastdist.strategies.topology import DataShard

GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR = (
    "FASTDIST_REPLICA_GROUP",
    "FASTDIST_REPLICA_GROUPS",
    "TORCHFT_LIGHTHOUSE",
)
#: Seconds between the quorums of a group's start that wait for the job's other groups.
JOIN_POLL_S = 0.5
#: How many times this group was started again: by torchrun, by a SLURM requeue.
RESTART_VARS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
LAUNCH_HINT = (
    "launch the groups with python -m fastdist ft --groups N SCRIPT (or set "
    f"{GROUP_VAR}, {GROUPS_VAR} and {LIGHTHOUSE_VAR} for each group's torchrun)"
)


def replica_layout(strategy: str, fault_tolerant: bool, min_replicas: int) -> tuple[int, int]:
    """``(index, count)`` of this process's replica group (``(0, 1)`` without
    ``fault_tolerant``); raise if ``min_replicas`` cannot be met (alike on every process)."""
    if not fault_tolerant:
        if min_replicas != 1:
            raise ValueError(
                f"{strategy}(min_replicas={min_replicas}) counts torchft replica groups: set "
                "fault_tolerant=True as well, or leave min_replicas at 1"
            )
        return 0, 1
    index, count = replica_group_from_env(strategy)
    if min_replicas > count:
        raise ValueError(
            f"{strategy}(fault_tolerant=True, min_replicas={min_replicas}) needs at least "
            f"{min_replicas} replica groups, but {GROUPS_VAR}={count}: no update could ever "
            f"commit. Set min_replicas to {count} or less, or launch more groups"
        )
    return index, count


def refuse_stream(train_data: Any, replica_group: tuple[int, int], shard: DataShard) -> DataShard:
    """This rank's ``shard`` of the data among every replica group's ranks; raise if
    ``train_data`` is a stream and there are several groups (its readers agree within one
    group only), alike on every process, before any collective."""
    if replica_group[1] > 1 and isinstance(train_data, IterableDataset):
        raise ValueError(
            "a streaming train_data (an IterableDataset) is not supported with "
            f"fault_tolerant=True and {replica_group[1]} replica groups: its readers agree "
            "within one group only. Pass a map-style Dataset (e.g. the stream's items in a list)"
        )
    return shard.across_groups(replica_group)


def replica_group_from_env(strategy: str = "DDP") -> tuple[int, int]:
    """``(index, count)`` of this process's replica group, from the launch's environment;
    raise naming the variable when it is missing or wrong (alike on every process)."""
    values = []
    for name in (GROUP_VAR, GROUPS_VAR):
        text = os.environ.get(name)
        if text is None or not text.strip().isdigit():
            raise ValueError(
                f"{strategy}(fault_tolerant=True) needs {name} set to a number, got {text!r}: "
                + LAUNCH_HINT
            )
        values.append(int(text))
    index, count = values
    if count < 1 or index >= count:
        raise ValueError(
            f"{GROUP_VAR}={index} must be below {GROUPS_VAR}={count} (groups 0..{count - 1})"
        )
    if not os.environ.get(LIGHTHOUSE_VAR):
        raise ValueError(f"{strategy}(fault_tolerant=True) needs {LIGHTHOUSE_VAR}: " + LAUNCH_HINT)
    return index, count


def check_reachable(url: str, timeout: float) -> None:
    """Raise if nothing listens at the Lighthouse's ``url`` (each process checks alike)."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    host, port = parsed.hostname or "localhost", parsed.port or 29510
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise RuntimeError(
            f"no torchft Lighthouse answers at {LIGHTHOUSE_VAR}={url} ({exc}): start one "
            "(torchft_lighthouse --min_replicas 1 --bind [::]:PORT) or " + LAUNCH_HINT
        ) from None


class ReplicaGroups:
    """This process's place among the replica groups, and the torchft Manager that runs them.

    Args:
        index: this group's index, from 0.
        count: how many replica groups the job has (the lost samples count against it).
        min_replicas: the fewest groups that may commit an update.
        timeout: seconds a quorum, a collective or a state transfer may take.
    """

    def __init__(self, index: int, count: int, min_replicas: int, timeout: float) -> None:
        self.index, self.count = index, count
        self.min_replicas, self.timeout = min_replicas, timeout
        self.state: TrainerState | None = None
        self.update_samples: Callable[[], list[int]] = lambda: [0] * count
        self.healed = False  # the state was just loaded from a peer
        self.trained = count  # groups that committed the last update
        self.joined = False  # a quorum was just formed by join()
        self.manager: Any = None
        self.model: Signature = {}
        self.frozen = "none"  # its frozen parameters (see same_model.frozen_parameters)
        self.checked = -1  # the last quorum whose groups were found to hold the same model
        self.odd_peer = ""  # how a peer's model that this group did not heal from differs

    def start(self, model: nn.Module, group: Any) -> Any:
        """Join the Lighthouse: create torchft's Manager (over its ``ProcessGroupGloo`` and
        HTTP checkpoint transport) for this process, a rank of the group's process ``group``;
        every new quorum checks that its groups hold the same ``model`` (this rank's shards
        of it, under FSDP, against the same rank's of every group)."""
        from torchft import Manager, ProcessGroupGloo

        self.model = signature(local_shards(model.state_dict()))
        self.frozen = frozen_parameters(model)
        self.group = group

        lighthouse = os.environ[LIGHTHOUSE_VAR]
        check_reachable(lighthouse, min(self.timeout, 10.0))
        limit = timedelta(seconds=self.timeout)
        store_addr, store_port = group_store(group)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=limit),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # heal before the update's forward, on the main thread
            timeout=limit,
            quorum_timeout=limit,
            connect_timeout=limit,
            rank=get_rank(),
            world_size=get_world_size(),
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"fastdist_{self.index}",  # torchft reads the index from its digits
        )
        weakref.finalize(self, self.manager.shutdown, wait=False)  # leave the Lighthouse
        return self.manager

    def share(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """Send ``state_dict()`` to a group that heals from this one; heal with
        ``load_state_dict`` (the checkpointer's parts)."""

        def load(state: Any) -> None:
            # A peer's model that differs is not loaded: start_update names the difference
            # on every group (a load error would end this group alone, for a reason it hides).
            theirs = signature(state["model"])  # the strategy's part (Strategy.checkpoint_parts)
            if theirs != self.model:
                self.odd_peer = differences(self.model, theirs, "this group", "the peer")
                return
            load_state_dict(state)
            self.healed = True

        self.manager.register_state_dict_fn("fastdist", load, state_dict)

    def bind(self, state: TrainerState, update_samples: Callable[[], list[int]]) -> None:
        """Count lost samples into ``state``; ``update_samples()``: each group's samples in
        the current update."""
        self.state, self.update_samples = state, update_samples

    def join(self) -> str | None:
        """The first quorum, before training: heal from a peer if one is ahead; return where
        the state came from (``None``: this group's own). A group's start waits (at most
        ``timeout``) for the job's other groups: a quorum formed before they start would train
        its first updates alone and count their samples lost; and a restarted group alone may
        be one of a whole job restarted (each group requeued), not the last one left."""
        restarts = sum(int(os.environ.get(var, "0") or 0) for var in RESTART_VARS)
        self._quorum()
        self._wait_for_groups()
        self.joined = True  # the first update needs no quorum of its own
        healed, self.healed = self.healed, False
        if restarts and self.count > 1 and not healed and self.manager.num_participants() == 1:
            raise RuntimeError(
                f"replica group {self.index} was restarted (attempt {restarts + 1}) but no live "
                "replica group is there to heal it: the others have finished or failed, and "
                "training on alone from this group's own step would train the job again. "
                "Restart the whole job (with save_path set, it resumes from the newest "
                "checkpoints)"
            )
        return f"a peer replica group at step {self.manager.current_step()}" if healed else None

    def _wait_for_groups(self) -> None:
        """Form quorums until every group of the job is in one, for ``timeout`` seconds at
        most (the ranks of a group see the same quorums, so they try alike); then go on with
        the groups there: the others heal from them when they join."""
        for _ in range(int(self.timeout / JOIN_POLL_S)):
            if self.manager.num_participants() >= self.count:
                return
            time.sleep(JOIN_POLL_S)
            self._quorum()
        if self.manager.num_participants() < self.count:
            logger.warning(
                "replica group %d starts with %d of the job's %d groups after waiting %g s for "
                "the others (timeout): they heal from it when they join, and the samples of "
                "the updates they miss count as lost",
                self.index,
                self.manager.num_participants(),
                self.count,
                self.timeout,
            )

    def start_update(self) -> None:
        """A quorum before an update's forward: reconfigure the groups. A group behind the
        others heals only at its start (:meth:`join`), where it adopts the peer's whole
        position (epoch, sampler, step): behind at a later quorum, it stops with an error
        (its launcher then restarts it, and it heals at that start)."""
        if self.joined:
            self.joined = False
            return
        self._quorum()
        if self.healed:
            raise RuntimeError(
                f"replica group {self.index} fell behind the other groups and healed from one "
                f"at step {self.manager.current_step()} in the middle of its training, where "
                "it cannot take up the peer's place in the data: this group stops so that its "
                "launcher restarts it (it then heals at its start, at the peer's epoch and "
                "position). Launch it with restarts (python -m fastdist ft --max-restarts N)"
            )

    def _quorum(self) -> None:
        """torchft's quorum (healing this group if it is behind); checks of the groups in it."""
        try:
            self.manager.start_quorum()
        except Exception as exc:  # torchft's quorum call to the Lighthouse, bounded by timeout
            url = os.environ[LIGHTHOUSE_VAR]
            try:
                check_reachable(url, 5.0)
                cause = f"the Lighthouse at {LIGHTHOUSE_VAR}={url} answers, but " + (
                    f"fewer than min_replicas={self.min_replicas} replica groups joined the "
                    "quorum: the others have failed or finished (restart them, or lower "
                    "min_replicas)"
                    if self.min_replicas > 1
                    else "a rank of this group, or of a live group of the last quorum, did "
                    "not ask for this one (it is stuck)"
                )
            except RuntimeError:
                cause = f"is the Lighthouse at {LIGHTHOUSE_VAR}={url} still running?"
            raise RuntimeError(
                f"replica group {self.index} got no torchft quorum within {self.timeout:g} s "
                f"({type(exc).__name__}: {exc}): {cause}. Restart the job (with save_path set, "
                "it resumes from the newest checkpoints)"
            ) from exc
        ranks = self._quorum_ranks()
        if len(set(ranks)) != len(ranks):
            reused = sorted({r for r in ranks if ranks.count(r) > 1})
            raise ValueError(
                f"{GROUP_VAR} {reused} is used by more than one replica group in this quorum: "
                f"give each group its own index 0..{self.count - 1}"
            )
        self._check_model()

    def _quorum_ranks(self) -> list[int]:
        """The global ranks (group index x group size + rank) of this rank and its peers in
        the quorum, read from torchft's process group: no public API of torchft 0.2.0 (the
        version the ``ft`` extra pins) says which groups a quorum holds."""
        return list(getattr(self.manager._pg, "_global_ranks", None) or [])

    def _check_model(self) -> None:
        """At a new quorum: raise alike on every group in it if their models differ."""
        quorum = self.manager._quorum_id
        mine = {**self.model, FROZEN: self.frozen, PROCESSES: str(get_world_size())}
        alone = self.manager.num_participants() == 1
        if quorum != self.checked and not alone and check_same(self.manager, self.index, mine):
            self.checked = quorum
        if self.odd_peer:  # the check could not run (a peer failed), or missed it
            raise ValueError(
                f"replica group {self.index} cannot heal from a peer whose model differs: "
                f"{self.odd_peer}: {FIX}"
            )

    def check_in_sync(self, replicas: list[tuple[str, torch.Tensor]], step: int) -> None:
        """``check_sync_every`` across the groups in the quorum: raise alike on every group if
        a checksum of their ``replicas`` differs after update ``step`` (skipped if the
        collective fails: torchft reconfigures at the next quorum)."""
        if not replicas or self.manager.num_participants() == 1:
            return
        sums = [(name, float(t.detach().double().sum())) for name, t in replicas]
        differs = agree(self.manager, repr(sums))[0] is False  # rank r of each group compared
        if get_world_size() > 1:  # every rank of this group raises alike, not rank r alone
            differs = any(all_gather_object(differs, self.group))
        if differs:
            raise RuntimeError(
                f"the replica groups' parameters differ after update {step} "
                "(check_sync_every): a group changed its model outside the updates (e.g. in a "
                "callback), or healed from a peer wrongly; restart the job from a checkpoint"
            )

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over the groups of this update's quorum (a group that heals
        adds nothing); ``tensor`` itself if the all-reduce failed (the update then does not
        commit). Every group calls it at the same place of the same update."""
        reduced = tensor.detach().clone()
        self.manager.allreduce(reduced).wait()
        return tensor if self.manager.errored() else reduced

    def commit(self) -> bool:
        """torchft's ``should_commit`` for this update; count the samples it lost."""
        committed = bool(self.manager.should_commit())
        ranks = self._quorum_ranks() or [self.index * get_world_size()]
        groups = {rank // get_world_size() for rank in ranks} if committed else set()
        trained = len(groups)
        samples = self.update_samples()
        lost = sum(n for group, n in enumerate(samples) if group not in groups)
        if self.state is not None:
            self.state.lost_samples += lost
            if trained != self.trained:  # logged as it changes, not at every update
                logger.warning(
                    "update %d: %d of %d replica groups committed it (%d samples lost)",
                    self.state.global_step + 1,
                    trained,
                    self.count,
                    lost,
                )
        self.trained = trained
        return committed

    def skipped(self) -> None:
        """An update skipped as non-finite (by every group in the quorum: they average one
        gradient): every group's samples of it count as lost."""
        if self.state is not None:
            self.state.lost_samples += sum(self.update_samples())

    def state_dict(self) -> dict[str, int]:
        """torchft's step and committed batches: a disk checkpoint resumes them."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(state)
