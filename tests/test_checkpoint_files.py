"""Checkpoint files in one process, with real files: their modes.

The trainer is tests/inprocess.py's: 24 samples in batches of 4, 6 updates an epoch.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from inprocess import make_trainer

from fastdist import DistTrainer
from fastdist.callbacks import Callback

pytestmark = pytest.mark.usefixtures("no_dist_env")


def trainer(save_path: Path | None, **kwargs: Any) -> DistTrainer:
    """The in-process trainer, saving under ``save_path`` (if given)."""
    path = None if save_path is None else str(save_path)
    return make_trainer(Callback(), save_path=path, **kwargs)


def test_files_get_the_users_umask(tmp_path: Path) -> None:
    """Checkpoints (a file; a sharded one's every file), the manifest and the best model are
    created like the user's other files: 0o666 less the umask, not 0o600."""
    old = os.umask(0o027)
    try:
        trainer(tmp_path / "ddp").train()
        trainer(tmp_path / "fsdp", strategy="fsdp").train()
    finally:
        os.umask(old)
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    names = {path.name for path in files}
    expected = {"step-00000006.pt", "manifest.json", ".metadata", "__0_0.distcp", "trainer.pt"}
    assert expected <= names, names
    assert len([path for path in files if path.name.startswith("best_")]) == 2, names
    modes = {str(path.relative_to(tmp_path)): stat.S_IMODE(path.stat().st_mode) for path in files}
    assert modes == dict.fromkeys(modes, 0o640)
