"""Checkpoints that survive crashes: atomic files, a checksummed manifest, safe loading.

Layout of a checkpoint directory::

    step-00000120.pt     torch.save of a dict of state dicts (tensors and plain data only)
    step-00000240/       a sharded checkpoint (see :mod:`fastdist.checkpoint.sharded`)
    manifest.json        [{"file": "step-00000120.pt", "crc32": ..., "step": 120}, ...]

A checkpoint is written to a temp file, checksummed, fsynced and renamed; only then is the
manifest replaced the same way, and only then are checkpoints beyond ``keep`` pruned. Loading
verifies the checksum and uses
``torch.load(weights_only=True)``, which refuses pickled code.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import zlib
from collections.abc import Iterator
from typing import IO, Any

import torch

from fastdist.logging import logger

MANIFEST = "manifest.json"
SHARDED_REST = "trainer.pt"  # a sharded checkpoint's every part but the sharded ones


@contextlib.contextmanager
def _atomic_file(path: str) -> Iterator[IO[bytes]]:
    """Yield a new temp file next to ``path``; on success fsync it and rename it over ``path``.

    ``open(..., "xb")`` creates it with mode 0o666 less the umask, as the user's other files
    (``tempfile.mkstemp`` would make it 0o600), without touching the process-wide umask.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
    try:
        with open(tmp, "xb") as f:  # f.name is the temp file's path
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


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
    with _atomic_file(path) as f:
        torch.save(obj, f)
        f.flush()
        crc32 = _crc32(f.name)
    return crc32


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


class CheckpointDir:
    """The checkpoints of one run in ``directory``, newest last in the manifest."""

    def __init__(self, directory: str, keep: int) -> None:
        self.directory = directory
        self.keep = keep

    def entries(self) -> list[dict[str, Any]]:
        """Manifest entries, oldest first (empty when there is no manifest)."""
        path = os.path.join(self.directory, MANIFEST)
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return list(json.load(f))

    def save(self, checkpoint: dict[str, Any], step: int) -> str:
        """Write ``checkpoint`` durably, record it in the manifest, prune old ones."""
        path = os.path.join(self.directory, f"step-{step:08d}.pt")
        self.record(path, atomic_save(checkpoint, path), step)
        return path

    def record(self, path: str, crc32: int, step: int) -> None:
        """Name the durable checkpoint ``path`` (a file, or a sharded checkpoint's directory,
        ``crc32`` that of its ``trainer.pt``) in the manifest, then prune the oldest."""
        name = os.path.basename(path)
        entries = [e for e in self.entries() if e["file"] != name]
        entries.append({"file": name, "crc32": crc32, "step": step})
        kept, dropped = entries[-self.keep :], entries[: -self.keep]
        with _atomic_file(os.path.join(self.directory, MANIFEST)) as f:
            f.write(json.dumps(kept, indent=1).encode())
        for old in dropped:  # only now that the new checkpoint and manifest are durable
            old_path = os.path.join(self.directory, old["file"])
            if os.path.isdir(old_path):
                shutil.rmtree(old_path, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(old_path)

    def load_latest(self) -> tuple[dict[str, Any], str] | None:
        """The newest checkpoint that verifies and loads, with its path; warn on bad ones."""
        for entry in reversed(self.entries()):
            path = os.path.join(self.directory, entry["file"])
            try:
                if _crc32(_rest_file(path)) != entry["crc32"]:
                    raise ValueError("its CRC-32 does not match the manifest (truncated?)")
                return load_checkpoint(path), path
            except Exception as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
        return None


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
