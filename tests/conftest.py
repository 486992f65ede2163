"""Shared fixtures: a one-process world for in-process tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

# Import fastdist from this checkout even when it is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch import TORCHRUN_VARS  # noqa: E402


@pytest.fixture
def no_dist_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Clear torchrun's variables; fail the test if it leaves a process group behind."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized(), "a process group was left by an earlier test"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group initialised")
