"""Checkpoints as a dict of named parts, each of which saves and restores itself.

A *part* is any object with ``state_dict()``/``load_state_dict()`` registered under a stable
name, with a *scope* that says where its state lives:

* ``REPLICATED``: the same on every rank; rank 0's is saved once and every rank loads it.
* ``PER_RANK``: each rank's own (its random generators, a stream's position, PowerSGD's error
  feedback); every rank's is saved and each rank gets its own back. On another world size the
  part decides: ``load_resized(states)`` gets every saved rank's state.
* ``GATHERED``: a whole state assembled from parts that ranks hold (a pipeline's stages):
  ``state_dict()`` is called on every rank (it may gather, a collective) and rank 0's is
  saved as a replicated state would be, which every rank loads; so a replicated state and a
  gathered one read each other's checkpoints.
* ``SHARDED``: held in shards (FSDP's DTensors); every rank writes its shards with DCP, which
  reshards them on load. ``state_dict()`` returns the state dict DCP loads into in place.

The checkpointer saves what is registered and nothing else; it is a no-op without a
directory, so the loop calls it unconditionally. With a *background*
(:mod:`fastdist.checkpoint.background`) it writes while training goes on, one checkpoint at a
time, the manifest last. A *mirror* (Ray Train's, see :mod:`fastdist.trainer.ray_report`) is
handed every checkpoint written and may bring a newer one into the directory before an
``"auto"`` resume.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastdist.checkpoint.background import Background
from fastdist.checkpoint.files import (
    SHARDED_REST,
    CheckpointDir,
    atomic_save,
    checkpoint_write_failure,
)
from fastdist.checkpoint.format1 import upgrade
from fastdist.checkpoint.identity import refusal
from fastdist.checkpoint.loadable import unloadable
from fastdist.checkpoint.resume import choose
from fastdist.checkpoint.sharded import discard, load_shards, publish, write_shards
from fastdist.checkpoint.temps import clean
from fastdist.distributed import agree, broadcast_object, gather_object, get_rank, get_world_size
from fastdist.distributed.dtensor import as_shards, local_shards
from fastdist.logging import logger

REPLICATED, PER_RANK, SHARDED = "replicated", "per_rank", "sharded"
GATHERED = "gathered"
#: The layout this module writes: {"format", "world_size", "data_shards" (older: absent, the
#: world size), "parts", "per_rank", "sharded"} (the names of the parts in the DCP shards).
FORMAT = 2


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Mirror(Protocol):
    """Another store of the checkpoints (a scheduler's), kept by the checkpointer."""

    def fetch(self, directory: CheckpointDir) -> None:
        """On rank 0 before an ``"auto"`` resume: bring the store's newest checkpoint into
        ``directory`` unless it holds one as new (:meth:`CheckpointDir.import_newest`)."""

    def publish(self, directory: CheckpointDir, path: str | None) -> None:
        """On every rank after each save: hand over the checkpoint ``path`` of ``directory``
        (rank 0's; ``None`` on the others)."""


class Peer(Protocol):
    """A live peer that sends this process's parts instead of a disk checkpoint (torchft's
    replica groups, :mod:`fastdist.strategies.replica_groups`)."""

    def share(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """What to send a peer that heals from us, and how to heal from one."""
        ...

    def join(self) -> str | None:
        """Join the peers before training, healed if one is ahead; say from where (``None``:
        not healed)."""
        ...


@dataclass(frozen=True)
class Part:
    """A registered part: its name in the checkpoint, the object, its scope."""

    name: str
    obj: Any  # Stateful; a PER_RANK part also has load_resized(states)
    scope: str


@dataclass(frozen=True)
class Resumed:
    """Where a restored checkpoint came from."""

    path: str
    world_size: int
    data_shards: int  # the data's shards in the run that wrote it
    rollback: bool = False  # newer checkpoints of the directory were set aside


class Checkpointer:
    """Saves every registered part; finds a checkpoint to resume from and restores them.

    Args:
        directory: where checkpoints go; ``None`` disables checkpointing.
        every: also checkpoint every N optimizer updates (0: at epoch ends only).
        keep: how many of the newest checkpoints to keep.
        group: the process group of the checkpoint's collectives.
        mirror: another store every checkpoint is handed to, and resumed from when newer.
        background: write checkpoints in the background, on its group
            (:mod:`fastdist.checkpoint.background`); ``None``: each while training waits.
        peer: heals every part from a live peer that is ahead (torchft's replica groups).
        data_shards: how many shards the data is split into (the world size, but for ranks
            that share one: a pipeline's stages, tensor-parallel peers).
        identity: the model and optimizer it saves (:mod:`fastdist.checkpoint.identity`): a
            checkpoint written for others is refused before anything loads.
    """

    def __init__(
        self,
        directory: str | None,
        every: int,
        keep: int,
        group: Any = None,
        mirror: Mirror | None = None,
        background: Background | None = None,
        peer: Peer | None = None,
        data_shards: int | None = None,
        identity: dict[str, Any] | None = None,
    ) -> None:
        self.dir = CheckpointDir(directory, keep) if directory else None
        self.every = every
        self.group = group
        self.mirror = mirror
        self.background = background
        self.rank, self.world_size = get_rank(), get_world_size()
        self.data_shards = data_shards or self.world_size
        self.parts: dict[str, Part] = {}
        self.identity = identity
        self.peer = peer
        if peer is not None:
            peer.share(self._live_state, self._load_live)

    def register(self, name: str, obj: Any, scope: str = REPLICATED) -> None:
        """Save ``obj``'s state under ``name`` in every checkpoint, restore it on resume."""
        if name in self.parts:
            raise ValueError(f"a checkpoint part is already registered as {name!r}")
        if scope == PER_RANK and not callable(getattr(obj, "load_resized", None)):
            raise TypeError(f"per-rank part {name!r} needs load_resized(states)")
        self.parts[name] = Part(name, obj, scope)

    def due(self, step: int) -> bool:
        """Whether the schedule asks for a checkpoint after update ``step``."""
        return self.dir is not None and self.every > 0 and step % self.every == 0

    def save(self, step: int) -> str | None:
        """Write a checkpoint of every part (a collective); return its path on rank 0.

        In the background (``background`` given), the write in flight is waited for first, the
        state is copied off the live tensors, and the write goes on while training does: this
        returns ``None``, and :meth:`wait` the path.
        """
        if self.dir is None:
            return None
        self.wait()  # one write in flight at most; a failed one raises here, on every rank
        content = self._content()
        sharded = {p.name: p.obj.state_dict() for p in self._scoped(SHARDED)}
        background = self.background
        group = self.group if background is None else background.group
        finish = None
        if sharded:
            _, tmp = self._sharded_dirs(step)
            stager = None if background is None else background.shard_stager()
            finish = write_shards(sharded, tmp, self.rank == 0, group, stager)
        if background is None:
            return self._written(self._write(content, sharded, finish, step, group))
        content = background.copy(content)  # training changes the live tensors meanwhile
        background.start(functools.partial(self._write, content, sharded, finish, step, group))
        return None

    def wait(self) -> str | None:
        """Wait for the checkpoint written in the background, if any (then a collective): its
        path on rank 0, ``None`` on the others or when none was. Raises its failure
        (``OSError``) alike on every rank."""
        if self.background is None:
            return None
        pending, path = self.background.wait()
        return self._written(path) if pending else None

    def _content(self) -> dict[str, Any]:
        """What rank 0 writes with ``torch.save`` (every part but the sharded ones; empty on
        the other ranks), checked to load back: else every rank raises alike. Collectives."""
        whole = {p.name: p.obj.state_dict() for p in self._scoped(GATHERED)}  # every rank
        own = {p.name: p.obj.state_dict() for p in self._scoped(PER_RANK)}
        ranks = gather_object(own, self.group)  # the per-rank states, on rank 0
        content: dict[str, Any] = {}
        if ranks is not None:
            replicated = {p.name: p.obj.state_dict() for p in self._scoped(REPLICATED)}
            content = {
                "format": FORMAT,
                "world_size": self.world_size,
                "data_shards": self.data_shards,
                "parts": {**replicated, **whole},
                "per_rank": {name: [states[name] for states in ranks] for name in own},
                "sharded": [p.name for p in self._scoped(SHARDED)],
                "identity": self.identity,
            }
        problem = unloadable(content) if ranks is not None else None  # rank 0's content
        problem = broadcast_object(problem, group=self.group)
        if problem is not None:  # nothing written; every rank raises alike
            raise TypeError(problem)
        return content

    def _write(
        self,
        content: dict[str, Any],
        sharded: dict[str, Any],
        finish: Callable[[], dict[str, int]] | None,
        step: int,
        group: Any,
    ) -> str:
        """Write the checkpoint of ``step`` (collectives of ``group``): ``content`` by rank 0,
        the whole of it, or a sharded one's rest beside the shards that ``finish`` writes (or
        waits for) into a temp dir, then one rename; the manifest last, with the CRC-32 of
        every file. Return its path. A failure on any rank raises ``OSError`` on every rank.

        Each rank checksums the files it wrote, from its page cache and in parallel with the
        others; one all-gather brings them to rank 0 and tells it that every rank has finished.
        """
        assert self.dir is not None
        directory, master = self.dir, self.rank == 0
        if finish is None:
            return agree(lambda: directory.save(content, step) if master else "", group)[0]
        path, tmp = self._sharded_dirs(step)

        def write() -> dict[str, int]:
            from torch.distributed.checkpoint.api import CheckpointException  # DCP: ~0.7 s

            try:
                written = finish()
            except CheckpointException as exc:  # DCP raises it on every rank: a full disk...
                cause = exc.failures[min(exc.failures)][0]  # the first failed rank's error
                raise OSError(checkpoint_write_failure(path, sharded, cause)) from exc
            if master:
                written[SHARDED_REST] = atomic_save(content, os.path.join(tmp, SHARDED_REST))
            return written

        try:
            ranks = agree(write, group)
        except OSError:
            if master:  # the shards written meanwhile: nothing names them
                discard(tmp)
            raise
        files = dict(sorted(item for checksums in ranks for item in checksums.items()))

        def record() -> None:
            publish(tmp, path)
            directory.record(path, files[SHARDED_REST], step, files)

        agree(lambda: record() if master else None, group)
        return path

    def _sharded_dirs(self, step: int) -> tuple[str, str]:
        """A sharded checkpoint's directory, and the temp one it is written in."""
        assert self.dir is not None
        where = self.dir.directory
        return os.path.join(where, f"step-{step:08d}"), os.path.join(where, f".tmp-step-{step:08d}")

    def _written(self, path: str) -> str | None:
        """Log the checkpoint ``path`` written, hand it to the mirror; the path on rank 0."""
        assert self.dir is not None
        if self.rank == 0:
            logger.info("checkpoint written: %s", path)
        mine = path if self.rank == 0 else None
        if self.mirror is not None:
            self.mirror.publish(self.dir, mine)
        return mine

    def restore(self, resume: bool | str | os.PathLike) -> Resumed | None:
        """Restore every part from the checkpoint ``train(resume=...)`` asks for (a collective):
        ``"auto"``: the newest in the directory that verifies, if any; a path: that one;
        ``False``: none. Return where it came from.

        Every rank restores the same checkpoint or raises the same error (see
        :mod:`fastdist.checkpoint.resume`). A run may not prune or overwrite checkpoints it does
        not continue: a fresh start, or a resume from elsewhere, in a directory that holds
        checkpoints is refused. Then a live ``peer`` that is ahead (torchft's replica groups)
        overwrites every part with its own state.
        """
        resumed = self._restore_saved(resume)
        healed = None if self.peer is None else self.peer.join()  # a live peer may be ahead
        return resumed if healed is None else Resumed(healed, self.world_size, self.data_shards)

    def _restore_saved(self, resume: bool | str | os.PathLike) -> Resumed | None:
        """Restore every part from the checkpoint on disk that ``resume`` asks for."""
        fetch = None if self.mirror is None else self.mirror.fetch
        found = choose(resume, self.dir, self.group, fetch)
        if self.dir is not None and self.rank == 0:  # killed writes' temps: a crash loop
            clean(self.dir.directory)  # would fill the disk (the ranks agreed on `found`)
        if found is None:
            return None
        saved, path, rollback = found
        checkpoint = upgrade(saved)
        problem = refusal(checkpoint.get("identity"), self.identity, path)
        if problem is not None:  # alike on every rank: each read the file, and holds the same
            raise ValueError(problem)
        for part in self.parts.values():
            self._check_saved(checkpoint, part, path)
        for part in self._scoped(REPLICATED) + self._scoped(GATHERED):
            part.obj.load_state_dict(checkpoint["parts"][part.name])
        for part in self._scoped(PER_RANK):
            states = checkpoint["per_rank"][part.name]
            if len(states) == self.world_size:
                part.obj.load_state_dict(states[self.rank])
            else:
                part.obj.load_resized(states)
        sharded = {p.name: p.obj.state_dict() for p in self._scoped(SHARDED)}
        if sharded:
            load_shards(sharded, path, self.group)
            for part in self._scoped(SHARDED):
                part.obj.load_state_dict(sharded[part.name])
        world_size = checkpoint["world_size"]
        return Resumed(path, world_size, checkpoint.get("data_shards", world_size), rollback)

    def _live_state(self) -> dict[str, Any]:
        """This rank's view of every part, as a live peer sends it (no collective: it is
        called in torchft's quorum thread)."""
        held = [p for p in self.parts.values() if p.scope != GATHERED]
        if len(held) != len(self.parts):
            raise ValueError("healing from a peer takes replicated, per-rank and sharded parts")
        # A sharded part as this rank's local shards: the peer's matching rank holds the same.
        # A part may send a peer other than what it saves (live_state_dict: e.g. a file's
        # content instead of its path).
        return {part.name: local_shards(_live_state(part.obj)) for part in held}

    def _load_live(self, state: dict[str, Any]) -> None:
        """Load what a peer's :meth:`_live_state` sent."""
        for part in self.parts.values():
            received = state[part.name]
            if part.scope == SHARDED:
                received = as_shards(received, part.obj.state_dict())
            _load_live_state(part.obj, received)

    def _check_saved(self, checkpoint: dict[str, Any], part: Part, path: str) -> None:
        """Raise (alike on every rank, before any collective) if ``part`` is not in the
        checkpoint as this run holds it."""
        where = {
            REPLICATED: "parts",
            PER_RANK: "per_rank",
            SHARDED: "sharded",
        }
        saved_in = [scope for scope, key in where.items() if part.name in checkpoint[key]]
        if (REPLICATED if part.scope == GATHERED else part.scope) in saved_in:
            return
        if saved_in:
            raise ValueError(
                f"checkpoint {path} holds {part.name!r} as a {saved_in[0]} state, but this run "
                f"holds it {part.scope}: resume it under a strategy that writes it so (a "
                "sharded checkpoint with strategy='fsdp' or Pipeline(stages=N, "
                "stage_strategy=FSDP()), a full one with strategy='ddp', Pipeline(stages=N) or "
                "one process)"
            )
        raise ValueError(
            f"checkpoint {path} holds no {part.name!r} state: it was not written by this "
            "trainer; pass another checkpoint, or start afresh in another "
            "save_path/checkpoint_dir"
        )

    def _scoped(self, scope: str) -> list[Part]:
        return [part for part in self.parts.values() if part.scope == scope]


def _live_state(obj: Any) -> Any:
    """What part ``obj`` sends a healing peer: its ``live_state_dict()`` if it has one."""
    return getattr(obj, "live_state_dict", obj.state_dict)()


def _load_live_state(obj: Any, state: Any) -> None:
    """Load what :func:`_live_state` sent into part ``obj``."""
    getattr(obj, "load_live_state_dict", obj.load_state_dict)(state)
