"""Checkpoints that survive crashes: atomic files, a checksummed manifest, safe loading.

Layout of a checkpoint directory::

    step-00000120.pt     torch.save of a dict of state dicts (tensors and plain data only)
    step-00000240/       a sharded checkpoint (see :mod:`fastdist.checkpoint.sharded`)
    manifest.json        [{"file": "step-00000120.pt", "crc32": ..., "step": 120},
                          {"file": "step-00000240", "crc32": ..., "step": 240,
                           "files": {".metadata": ..., "__0_0.distcp": ..., "trainer.pt": ...}}]

``crc32`` is the CRC-32 of the file, or of a sharded checkpoint's ``trainer.pt``; ``files``
(sharded checkpoints; absent from entries of earlier versions) that of every file in it. A
checkpoint is written to a temp file, checksummed, fsynced and renamed; only then is the
manifest replaced the same way, and only then are this run's checkpoints beyond ``keep``
pruned. Files are created like any file of the user's (mode 0o666 less the umask). Loading
verifies the checksums and uses ``torch.load(weights_only=True)``, which refuses pickled code.

A write killed before its rename leaves its temp (``.tmp-<hex>-step-00000120.pt``,
``.tmp-step-00000240/``). Its writer holds an ``flock`` on it while it lives, which the kernel
releases when the process ends; :func:`~fastdist.checkpoint.temps.remove_stale` removes the
temps of this naming that no one holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import torch

from fastdist.checks import first_line

MANIFEST = "manifest.json"
SHARDED_REST = "trainer.pt"  # a sharded checkpoint's every part but the sharded ones
_STEP_NAME = re.compile(r"step-(\d+)(\.pt)?$")  # a checkpoint's name, as this module writes it


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[IO[bytes]]:
    """Yield a new temp file next to ``path``; on success fsync it and rename it over ``path``.

    ``open(..., "xb")`` creates it with mode 0o666 less the umask, as the user's other files
    (``tempfile.mkstemp`` would make it 0o600), without touching the process-wide umask. It is
    locked (``flock``) until renamed: a live write's, which no one removes.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
    try:
        with open(tmp, "xb") as f:  # f.name is the temp file's path
            fcntl.flock(f, fcntl.LOCK_EX)
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # still locked
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def new_file_mode(directory: str) -> int:
    """The permission bits a file created in ``directory`` gets (0o666 less the umask, or as
    the directory's default ACL says), found by creating one: reading the umask would mean
    setting it, process-wide."""
    probe = os.path.join(directory, f".tmp-{uuid.uuid4().hex}-mode")
    with open(probe, "xb") as f:
        mode = os.fstat(f.fileno()).st_mode & 0o777
    os.unlink(probe)
    return mode


def claim_new(stem: str, suffix: str = "", folder: bool = False) -> str:
    """Create the empty file (or ``folder``) ``stem + suffix``, else ``stem-2 + suffix``,
    ``stem-3``...: the first name no one holds, created exclusively (two processes claiming
    at once get two names). Return its path."""
    for n in itertools.count(1):
        path = stem + ("" if n == 1 else f"-{n}") + suffix
        try:
            if folder:
                os.mkdir(path)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def fsync_dir(directory: str) -> None:
    """Make a rename inside ``directory`` durable (before anything names its result)."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_save(obj: Any, path: str) -> int:
    """``torch.save`` ``obj`` to ``path`` atomically; return the file's CRC-32.

    torch writes the file itself (its fast path: a Python wrapper around the file would slow
    it down 3x); the checksum is read back from the page cache before the rename. CRC-32
    catches truncation and corruption at GB/s, where sha256 would double the cost (measured
    with benchmarks/checkpoint.py).
    """
    try:
        with atomic_file(path) as f:
            torch.save(obj, f)
            f.flush()
            checksum = crc32(f.name)
    except (OSError, RuntimeError) as exc:  # a full disk: torch says "unexpected pos ..."
        interrupt = _interrupt_behind(exc)
        if interrupt is not None:  # Ctrl-C in the write: torch's writer then fails to close
            raise interrupt from None
        raise OSError(checkpoint_write_failure(path, obj, exc)) from exc
    return checksum


def _interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The ``KeyboardInterrupt`` among the exceptions ``exc`` was raised while handling."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return seen
        seen = seen.__context__
    return None


def checkpoint_write_failure(path: str, obj: Any, exc: BaseException) -> str:
    """:func:`write_failure` of the checkpoint ``path`` (of ``obj``), advising the resume."""
    return write_failure("the checkpoint", path, obj, exc, _RESUME_FIX)


_RESUME_FIX = (
    "free space or use another save_path/checkpoint_dir, then train(resume='auto') "
    "continues from the newest intact checkpoint"
)


def write_failure(what: str, path: str, obj: Any, exc: BaseException, fix: str) -> str:
    """Why writing ``what`` (the tensors of ``obj``) to ``path`` failed, in one line ending
    in ``fix``: no space, if less is free than it needs, else ``exc``'s own words."""
    size = _tensor_bytes(obj)
    usage = shutil.disk_usage(os.path.dirname(os.path.abspath(path)))
    if usage.free < size or getattr(exc, "errno", None) == errno.ENOSPC:
        cause = f"no space left on its filesystem ({_mib(usage.free)} free)"
    else:
        cause = f"{type(exc).__name__}: {first_line(exc, 300)}"
    sized = f" (about {_mib(size)} of tensors)" if size else ""
    return f"could not write {what} {path}{sized}: {cause}; {fix}"


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj`` (dicts, lists and tuples searched)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(map(_tensor_bytes, obj.values()))
    if isinstance(obj, (list, tuple)):
        return sum(map(_tensor_bytes, obj))
    return 0


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def crc32(path: str) -> int:
    """The CRC-32 of the file ``path``."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def expected_checksums(directory: str, entry: dict[str, Any]) -> dict[str, int]:
    """The CRC-32 of every file of the checkpoint a manifest ``entry`` names, by path: a
    sharded checkpoint's files (entries written before ``files`` hold only ``trainer.pt``'s)."""
    path = os.path.join(directory, entry["file"])
    if "files" in entry:
        return {os.path.join(path, name): crc for name, crc in entry["files"].items()}
    return {_rest_file(path): entry["crc32"]}


def _plain_name(name: Any) -> bool:
    """Whether ``name`` names an entry of the directory itself (no path: pruning stays in it)."""
    return isinstance(name, str) and os.path.basename(name) == name and name not in ("", ".", "..")


def _valid_entry(entry: Any) -> bool:
    """Whether ``entry`` is a manifest entry as :meth:`CheckpointDir.record` writes them."""
    if not isinstance(entry, dict) or not _plain_name(entry.get("file")):
        return False
    if not (isinstance(entry.get("crc32"), int) and isinstance(entry.get("step"), int)):
        return False
    files = entry.get("files", {})
    return isinstance(files, dict) and all(
        _plain_name(name) and isinstance(crc, int) for name, crc in files.items()
    )


class CheckpointDir:
    """The checkpoints of one run in ``directory``, newest last in the manifest.

    Pruning removes only the run's own checkpoints: those it recorded, and those it adopted
    (the directory's, when it continues them). On rank 0, which writes them.
    """

    def __init__(self, directory: str, keep: int) -> None:
        self.directory = directory
        self.keep = keep
        self.own: set[str] = set()

    def entries(self) -> list[dict[str, Any]]:
        """Manifest entries, oldest first (empty when there is no manifest); a manifest that
        is not one raises ``ValueError`` naming it."""
        path = os.path.join(self.directory, MANIFEST)
        try:
            with open(path, "rb") as f:
                entries = json.loads(f.read())
        except FileNotFoundError:
            return []
        except ValueError as exc:  # invalid JSON or UTF-8
            raise ValueError(_not_a_manifest(path, f"invalid JSON: {exc}")) from exc
        if not isinstance(entries, list) or not all(map(_valid_entry, entries)):
            shape = 'a list of {"file": name, "crc32": int, "step": int}'
            raise ValueError(_not_a_manifest(path, f"it is not {shape}"))
        return entries

    def held(self) -> dict[str, int]:
        """Every checkpoint the directory holds, by name, with its step: the manifest's and
        any other ``step-*`` file or directory (an unrecorded one, a copied one)."""
        found = {e["file"]: e["step"] for e in self.entries()}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                match = _STEP_NAME.match(name)
                if match:
                    found.setdefault(name, int(match.group(1)))
        return found

    def adopt(self, names: Iterable[str]) -> None:
        """Make the checkpoints ``names`` this run's own: the run continues them."""
        self.own.update(names)

    def save(self, checkpoint: dict[str, Any], step: int) -> str:
        """Write ``checkpoint`` durably, record it in the manifest, prune old ones."""
        path = os.path.join(self.directory, f"step-{step:08d}.pt")
        self.record(path, atomic_save(checkpoint, path), step)
        return path

    def record(
        self, path: str, checksum: int, step: int, files: dict[str, int] | None = None
    ) -> None:
        """Name the durable checkpoint ``path`` in the manifest (a file, ``checksum`` its CRC-32;
        or a sharded checkpoint's directory, ``checksum`` that of its ``trainer.pt`` and
        ``files`` that of each of its files), then prune this run's oldest."""
        name = os.path.basename(path)
        self.own.add(name)
        entry: dict[str, Any] = {"file": name, "crc32": checksum, "step": step}
        if files is not None:
            entry["files"] = files
        entries = [e for e in self.entries() if e["file"] != name] + [entry]
        owned = [e for e in entries if e["file"] in self.own]
        dropped = owned[: -self.keep]
        kept = [e for e in entries if e not in dropped]  # another run's stay listed
        try:
            _write_manifest(self.directory, kept)
        except OSError as exc:  # the checkpoint stays unrecorded: resume skips it
            self.own.discard(name)
            manifest = os.path.join(self.directory, MANIFEST)
            fix = f"{name} is not recorded; {_RESUME_FIX}"
            raise OSError(write_failure("the manifest", manifest, None, exc, fix)) from exc
        for old in dropped:  # only now that the new checkpoint and manifest are durable
            old_path = os.path.join(self.directory, old["file"])
            if os.path.isdir(old_path):
                shutil.rmtree(old_path, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(old_path)
            self.own.discard(old["file"])

    def set_aside(self, names: Iterable[str]) -> str:
        """Move the checkpoints ``names`` with their manifest entries into a new sibling
        directory named for the time, ``<directory>-set-aside-<time>`` (``-2``... if taken): a
        checkpoint directory of its own, to resume from. Return its path."""
        names = set(names)
        stamp = time.strftime("%Y-%m-%d-%H-%M-%S")
        stem = os.path.abspath(self.directory).rstrip(os.sep)
        aside = claim_new(f"{stem}-set-aside-{stamp}", folder=True)
        entries = self.entries()
        _write_manifest(aside, [e for e in entries if e["file"] in names])
        for name in sorted(names):  # one filesystem: renames, nothing copied
            os.replace(os.path.join(self.directory, name), os.path.join(aside, name))
        fsync_dir(aside)
        _write_manifest(self.directory, [e for e in entries if e["file"] not in names])
        fsync_dir(os.path.dirname(aside))
        return aside

    def export(self, path: str, destination: str) -> None:
        """Put this directory's checkpoint ``path`` and a manifest that lists it alone into the
        empty directory ``destination`` on the same filesystem (hard links, else copies)."""
        name = os.path.basename(path)
        entry = next(e for e in self.entries() if e["file"] == name)
        _copy(path, os.path.join(destination, name), os.link, shutil.copyfile)
        with open(os.path.join(destination, MANIFEST), "w") as f:
            json.dump([entry], f, indent=1)

    def import_newest(self, source: str) -> int | None:
        """Copy the newest checkpoint of the checkpoint directory ``source`` into this one,
        with its manifest entry and checksums, unless this one holds one as new (then
        ``None``); return its step. Written like a checkpoint: copied, fsynced, renamed,
        recorded."""
        entries = CheckpointDir(source, keep=1).entries()
        if not entries:
            return None
        entry = entries[-1]
        if max(self.held().values(), default=-1) >= entry["step"]:
            return None
        os.makedirs(self.directory, exist_ok=True)
        tmp = os.path.join(self.directory, f".tmp-{uuid.uuid4().hex}-{entry['file']}")
        try:
            _copy(os.path.join(source, entry["file"]), tmp, _copy_synced)
            path = os.path.join(self.directory, entry["file"])
            os.replace(tmp, path)
        except BaseException:
            remove(tmp)
            raise
        fsync_dir(self.directory)
        self.record(path, entry["crc32"], entry["step"], entry.get("files"))
        return int(entry["step"])


def _write_manifest(directory: str, entries: list[dict[str, Any]]) -> None:
    with atomic_file(os.path.join(directory, MANIFEST)) as f:
        f.write(json.dumps(entries, indent=1).encode())


def _copy(source: str, target: str, *copy_file: Callable[[str, str], Any]) -> None:
    """Copy the file or directory tree ``source`` to ``target`` with the first of ``copy_file``
    that succeeds for each file (the last one's error is raised)."""
    if os.path.isdir(source):
        os.makedirs(target)
        for name in sorted(os.listdir(source)):
            _copy(os.path.join(source, name), os.path.join(target, name), *copy_file)
        return
    for i, copy in enumerate(copy_file):
        try:
            copy(source, target)
            return
        except OSError:  # e.g. no hard links across filesystems: the next one
            if i == len(copy_file) - 1:
                raise


def _copy_synced(source: str, target: str) -> None:
    shutil.copyfile(source, target)
    with open(target, "rb") as f:
        os.fsync(f.fileno())


def remove(path: str) -> None:
    """Delete the file or folder ``path``, if there."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _not_a_manifest(path: str, why: str) -> str:
    return (
        f"{path} is not a checkpoint manifest ({why}): restore it, delete it (resume='auto' "
        "then finds none of the checkpoints it listed), or use another save_path/checkpoint_dir"
    )


def _rest_file(path: str) -> str:
    """The torch.save file of a checkpoint: the file itself, or a sharded one's rest."""
    return os.path.join(path, SHARDED_REST) if os.path.isdir(path) else path


def load_checkpoint(path: str) -> dict[str, Any]:
    """Load a checkpoint file, or a sharded checkpoint's ``trainer.pt``, with
    ``weights_only=True``: pickled code is refused. (A sharded checkpoint's shards are read by
    :func:`~fastdist.checkpoint.sharded.load_shards`.)"""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, ".metadata")):
        raise ValueError(f"{path} holds no DCP metadata: not a complete sharded checkpoint")
    return torch.load(_rest_file(path), map_location="cpu", weights_only=True)
