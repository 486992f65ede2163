"""A disk that fills up between two checkpoints, at 2 ranks: every rank fails with one error
naming the checkpoint, its size and the cause; no temp file stays; the last good checkpoint
does, and the resume that follows continues from it.

The filesystems are real ``tmpfs`` of 1.5 MiB (mounting needs root, as CI runs), one per
case; rank 0 of tests/workers/checkpoint_worker.py fills one after the first checkpoint. The
cases run one after another in one 2-rank launch (each launch costs seconds of start-up); a
case that raised has rank 0 list its checkpoint directory as the full disk left it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from launch import run_torchrun

WORKER = Path(__file__).resolve().parent / "workers" / "checkpoint_worker.py"
Outcomes = dict[str, Any]


def mount_tmpfs(mount: Path) -> None:
    """A 1.5 MiB tmpfs at ``mount`` (created); the test is skipped (failed in CI) without root."""
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root, yet mounting a tmpfs failed: {done.stderr.strip()}")
        pytest.skip(f"mounting a tmpfs needs root here: {done.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1.5 MiB tmpfs mounted at a fresh directory, unmounted after the test (also used by
    tests/test_loggers.py)."""
    mount = tmp_path / "tmpfs"
    mount_tmpfs(mount)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcomes]:
    """Every case in one launch, each full disk its own tmpfs: ``{"out": the launch's
    directory, "disk <case>": the tmpfs}`` and each case's outcomes by rank under its name."""
    out = tmp_path_factory.mktemp("disk_full")
    with ExitStack() as unmount:
        disks = {}
        for disk in ("plain", "best", "fsdp"):
            disks[disk] = out / f"tmpfs-{disk}"
            mount_tmpfs(disks[disk])
            unmount.callback(subprocess.run, ["umount", "-l", str(disks[disk])], check=False)
        plain = {"config": "plain", "save_path": str(disks["plain"] / "run"), "resume": False}
        filler = str(disks["plain"] / "filler")
        cases: list[dict[str, Any]] = [
            {**plain, "name": "full", "fill": [1, filler]},
            # space freed: the run goes on from its last good checkpoint
            {**plain, "name": "resumed", "resume": "auto", "unfill": filler},
            {
                "name": "best",  # the checkpoints elsewhere, the best model on the full disk
                "config": "plain",
                "save_path": str(disks["best"] / "run"),
                "checkpoint_dir": str(out / "checkpoints"),
                "resume": False,
                "evaluate": True,
                "fill": [1, str(disks["best"] / "filler"), 0],
            },
            {
                "name": "fsdp",
                "config": "fsdp",
                "save_path": str(disks["fsdp"] / "run"),
                "resume": False,
                "fill": [1, str(disks["fsdp"] / "f"), 0],
            },
        ]
        (out / "cases.json").write_text(json.dumps(cases))
        run_torchrun(WORKER, 2, [str(out / "cases.json"), str(out)], timeout=150)
        outcomes: Outcomes = {"out": out, **{f"disk {k}": v for k, v in disks.items()}}
        for case in cases:
            name = case["name"]
            outcomes[name] = [
                json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)
            ]
        yield outcomes


def left(runs: Outcomes, name: str) -> dict[str, Any]:
    """The checkpoint directory's names and the manifest's steps, as case ``name`` left them."""
    return json.loads((runs["out"] / f"{name}.left.json").read_text())


def test_a_full_disk_fails_every_rank_alike_and_the_resume_continues(runs: Outcomes) -> None:
    save_path, outcomes = runs["disk plain"] / "run", runs["full"]
    assert outcomes[0] == outcomes[1], f"the ranks disagree: {outcomes}"
    error = str(outcomes[0]["error"])
    checkpoints = save_path / "checkpoints"
    second = checkpoints / "step-00000002.pt"
    assert error.startswith(f"OSError: could not write the checkpoint {second} (about "), error
    assert " MiB of tensors): no space left on its filesystem (" in error
    assert "then train(resume='auto') continues from the newest intact checkpoint" in error
    assert "\n" not in error
    kept = [".fastdist.lock", "manifest.json", "step-00000001.pt"]  # the lock: this run's
    assert left(runs, "full") == {"names": kept, "steps": [1]}

    resumed = runs["resumed"]  # space freed: the run goes on from its last good checkpoint
    assert [outcome.get("error") for outcome in resumed] == [None, None], resumed
    assert [outcome["start_step"] for outcome in resumed] == [1, 1]


def test_a_full_disk_at_the_best_model_fails_every_rank_alike_leaving_no_file(
    runs: Outcomes,
) -> None:
    """The best model's filesystem full (the checkpoints elsewhere): every rank raises the
    same one-line error naming the best model's file, its size and the cause; no file stays."""
    save_path, outcomes = runs["disk best"] / "run", runs["best"]
    assert outcomes[0] == outcomes[1], f"the ranks disagree: {outcomes}"
    error = str(outcomes[0]["error"])
    assert error.startswith(f"OSError: could not write the best model {save_path}/best_"), error
    assert " MiB of tensors): no space left on its filesystem (" in error
    assert error.endswith("; free space or use another save_path"), error
    assert "\n" not in error
    assert not list(save_path.glob("best_*")), list(save_path.iterdir())


def test_a_full_disk_at_a_sharded_checkpoint_fails_every_rank_alike_leaving_no_temp_dir(
    runs: Outcomes,
) -> None:
    """FSDP's DCP shards on a full disk: the same one-line error as a checkpoint file's on
    every rank, not DCP's CheckpointException; its temp directory is removed."""
    save_path, outcomes = runs["disk fsdp"] / "run", runs["fsdp"]
    assert outcomes[0] == outcomes[1], f"the ranks disagree: {outcomes}"
    error = str(outcomes[0]["error"])
    checkpoints = save_path / "checkpoints"
    second = checkpoints / "step-00000002"
    assert error.startswith(f"OSError: could not write the checkpoint {second} (about "), error
    assert " MiB of tensors): no space left on its filesystem (" in error
    assert "then train(resume='auto') continues from the newest intact checkpoint" in error
    assert "\n" not in error
    assert sorted(os.listdir(checkpoints)) == [".fastdist.lock", "manifest.json", "step-00000001"]
