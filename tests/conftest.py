"""Shared fixtures (a one-process world for in-process tests), the ``gpu`` marker's skip and the
files' order (the longest first).

CPU tests pin themselves to the CPU: in-process ones pass ``device="cpu"``, launched ones see
no GPU (tests/launch.py). ``@pytest.mark.gpu`` / ``@pytest.mark.gpu(2)`` tests run where CUDA
shows that many GPUs and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Import fastdist from this checkout even when it is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch import TORCHRUN_VARS  # noqa: E402

from fastdist.logging import logger  # noqa: E402


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """Messages fastdist's logger emits meanwhile (it does not propagate to caplog)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(f"{record.levelname} {record.getMessage()}")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


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


#: The files that take longest (CI's durations, 30-80 s each), started first: each file runs
#: whole on one pytest-xdist worker, and a long one started last would leave the other idle.
LONGEST_FIRST = (
    "test_campaign.py",
    "test_faults.py",
    "test_resume.py",
    "test_matrix.py",
    "test_model_io.py",
    "test_tensor_parallel.py",
    "test_ft_rules.py",
    "test_ray.py",
    "test_pipeline.py",
    "test_stream.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the longest files first (each file's tests keep their order); skip ``gpu(n)``
    tests, naming why, unless CUDA shows at least ``n`` GPUs."""
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else 1
        if visible < needed:
            why = "torch.cuda.is_available() is False" if not visible else f"{visible} visible"
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s): {why}"))


@pytest.fixture(scope="session")
def launcher_reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The final parameters of tests/workers/launcher_worker.py trained by torchrun on 2 ranks,
    uninterrupted: what every launch of it must end with."""
    from launch import TESTS_DIR, run_torchrun

    out = tmp_path_factory.mktemp("launcher-reference")
    run_torchrun(TESTS_DIR / "workers" / "launcher_worker.py", 2, [str(out)], timeout=180)
    return json.loads((out / "0.rank0.json").read_text())["params"]
