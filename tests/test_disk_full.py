"""A disk that fills up between two checkpoints, at 2 ranks: every rank fails with one error
naming the checkpoint, its size and the cause; no temp file stays; the last good checkpoint
does, and the resume that follows continues from it.

The filesystem is a real ``tmpfs`` of 1.5 MiB (mounting needs root, as CI runs); rank 0 of
tests/workers/checkpoint_worker.py fills it after the first checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch import run_torchrun

WORKER = Path(__file__).resolve().parent / "workers" / "checkpoint_worker.py"


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1.5 MiB tmpfs mounted at a fresh directory, unmounted after the test."""
    mount = tmp_path / "tmpfs"
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
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def run_case(tmp_path: Path, case: dict[str, object]) -> list[dict[str, object]]:
    """Run one checkpoint_worker case at 2 ranks (bounded); each rank's outcome."""
    (tmp_path / "cases.json").write_text(json.dumps([case]))
    run_torchrun(WORKER, 2, [str(tmp_path / "cases.json"), str(tmp_path)], timeout=90)
    name = case["name"]
    return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]


def test_a_full_disk_fails_every_rank_alike_and_the_resume_continues(
    tmp_path: Path, tmpfs: Path
) -> None:
    save_path, filler = tmpfs / "run", tmpfs / "filler"
    case = {"config": "plain", "save_path": str(save_path), "resume": False}
    outcomes = run_case(tmp_path, {**case, "name": "full", "fill": [1, str(filler)]})
    assert outcomes[0] == outcomes[1], f"the ranks disagree: {outcomes}"
    error = str(outcomes[0]["error"])
    checkpoints = save_path / "checkpoints"
    second = checkpoints / "step-00000002.pt"
    assert error.startswith(f"OSError: could not write the checkpoint {second} (about "), error
    assert " MiB of tensors): no space left on its filesystem (" in error
    assert "then train(resume='auto') continues from the newest intact checkpoint" in error
    assert "\n" not in error
    kept = [".fastdist.lock", "manifest.json", "step-00000001.pt"]  # the lock: this run's
    assert sorted(os.listdir(checkpoints)) == kept
    manifest = json.loads((checkpoints / "manifest.json").read_text())
    assert [entry["step"] for entry in manifest] == [1]

    filler.unlink()  # space freed: the run goes on from its last good checkpoint
    resumed = run_case(tmp_path, {**case, "name": "resumed", "resume": "auto"})
    assert [outcome.get("error") for outcome in resumed] == [None, None], resumed
    assert [outcome["start_step"] for outcome in resumed] == [1, 1]


def test_a_full_disk_at_the_best_model_fails_every_rank_alike_leaving_no_file(
    tmp_path: Path, tmpfs: Path
) -> None:
    """The best model's filesystem full (the checkpoints elsewhere): every rank raises the
    same one-line error naming the best model's file, its size and the cause; no file stays."""
    save_path = tmpfs / "run"
    case = {
        "name": "best",
        "config": "plain",
        "save_path": str(save_path),
        "checkpoint_dir": str(tmp_path / "checkpoints"),
        "resume": False,
        "evaluate": True,
        "fill": [1, str(tmpfs / "filler"), 0],
    }
    outcomes = run_case(tmp_path, case)
    assert outcomes[0] == outcomes[1], f"the ranks disagree: {outcomes}"
    error = str(outcomes[0]["error"])
    assert error.startswith(f"OSError: could not write the best model {save_path}/best_"), error
    assert " MiB of tensors): no space left on its filesystem (" in error
    assert error.endswith("; free space or use another save_path"), error
    assert "\n" not in error
    assert not list(save_path.glob("best_*")), list(save_path.iterdir())


def test_a_full_disk_at_a_sharded_checkpoint_fails_every_rank_alike_leaving_no_temp_dir(
    tmp_path: Path, tmpfs: Path
) -> None:
    """FSDP's DCP shards on a full disk: the same one-line error as a checkpoint file's on
    every rank, not DCP's CheckpointException; its temp directory is removed."""
    save_path = tmpfs / "run"
    case = {"config": "fsdp", "save_path": str(save_path), "resume": False}
    outcomes = run_case(tmp_path, {**case, "name": "fsdp", "fill": [1, str(tmpfs / "f"), 0]})
    assert outcomes[0] == outcomes[1], f"the ranks disagree: {outcomes}"
    error = str(outcomes[0]["error"])
    checkpoints = save_path / "checkpoints"
    second = checkpoints / "step-00000002"
    assert error.startswith(f"OSError: could not write the checkpoint {second} (about "), error
    assert " MiB of tensors): no space left on its filesystem (" in error
    assert "then train(resume='auto') continues from the newest intact checkpoint" in error
    assert "\n" not in error
    assert sorted(os.listdir(checkpoints)) == [".fastdist.lock", "manifest.json", "step-00000001"]
