"""Checkpoints written in the background (``checkpoint_async=True``) at 2 ranks, DDP and FSDP:
each equals the synchronous one, tensor for tensor, though training went on while it was
written; a SIGKILL in the middle of one resumes from the previous checkpoint, bit-identical to
a straight run; a full disk fails every rank with the synchronous path's error.

tests/workers/async_checkpoint_worker.py slows, kills or fills the disk under rank 0's write
on purpose. Two launches: the synchronous and asynchronous runs with the full disks, then the
two kills, each resumed by torchrun's restart.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import Launch, free_port, run_together, run_torchrun, torchrun_command

WORKER = Path(__file__).resolve().parent / "workers" / "async_checkpoint_worker.py"
CONFIGS = ("plain", "fsdp")  # resume_worker.py's: DDP; FSDP with update_every=2
# Checkpoints every 2 updates: plain at 2, 4, ... 18 (3 kept); fsdp at 2, 4, 5, 6, 8, 10.
SLOWED = {"plain": 14, "fsdp": 6}  # a kept checkpoint, written while training goes on
KILLED = {"plain": (6, 4), "fsdp": (4, 2)}  # killed in the write of update A: resumes from B

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    """A 1.5 MiB tmpfs (as tests/test_disk_full.py's), or ``None`` where mounting needs root."""
    mount = tmp_path_factory.mktemp("tmpfs")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 and os.environ.get("CI"):
        pytest.fail(f"CI runs as root, yet mounting a tmpfs failed: {done.stderr.strip()}")
    try:
        yield mount if done.returncode == 0 else None
    finally:
        if done.returncode == 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def write_cases(out: Path, cases: list[dict[str, Any]]) -> str:
    (out / "cases.json").write_text(json.dumps(cases))
    return str(out / "cases.json")


def outcome(out: Path, name: str, rank: int, attempt: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{name}-{attempt}.rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tmpfs: Path | None) -> Path:
    """One launch: every config trained with synchronous and with asynchronous checkpoints
    (one write slowed by 0.5 s), then (with a tmpfs) a full disk under each."""
    out = tmp_path_factory.mktemp("runs")
    cases: list[dict[str, Any]] = []
    for config in CONFIGS:
        cases.append({"name": f"{config}-sync", "config": config, "async": False})
        slow = {"at": SLOWED[config], "slow": 0.5}
        cases.append({"name": f"{config}-async", "config": config, "async": True, **slow})
    if tmpfs is not None:  # plain: its file of update 4 fails; fsdp: its shards of update 4
        for config, when, at in (("plain", "before", 4), ("fsdp", "after", 2)):
            where = str(tmpfs / config)
            full = {"config": config, "async": True, "save_path": where, "at": at, "fill": when}
            cases.append({"name": f"{config}-full", **full})
    run_torchrun(WORKER, 2, [write_cases(out, cases), str(out)], timeout=300)
    return out


def load(path: Path) -> dict[str, Any]:
    """A checkpoint as torch objects: a file, or a sharded one's rest and its shards whole."""
    if path.is_file():
        return torch.load(path, weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = path.with_name(path.name + ".whole.pt")
    dcp_to_torch_save(path, whole)
    return {"rest": load(path / "trainer.pt"), "shards": torch.load(whole, weights_only=True)}


def assert_equal(got: Any, expected: Any, where: str) -> None:
    """Bit-exact equality of nested dicts, lists and tensors (dtype and shape included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        assert torch.equal(got, expected), f"{where}: the tensors differ"
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(expected), where
        for key in expected:
            assert_equal(got[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_equal(a, b, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def manifest(checkpoints: Path) -> list[dict[str, Any]]:
    return json.loads((checkpoints / "manifest.json").read_text())


@pytest.mark.parametrize("config", CONFIGS)
def test_an_async_checkpoint_equals_the_sync_one(runs: Path, config: str) -> None:
    """Training went on during the slowed write (the state was copied first); every kept
    checkpoint loads to the synchronous run's, tensor for tensor; the files get the same mode
    (the user's umask); the runs end with the same parameters; ``on_train_end`` comes after the
    last write."""
    for rank in range(2):
        sync, background = (outcome(runs, f"{config}-{how}", rank) for how in ("sync", "async"))
        assert background["final"] == sync["final"], f"rank {rank}: the training differs"
        # on_train_end sees the last checkpoint on disk (check-resume ends the process there).
        assert background["newest_at_end"] == sync["newest_at_end"] == sync["steps"]
    # Rank 0's torch.save of update S's state began at update `start`, ended after `end`: the
    # next checkpoint (S + 2) waited for it.
    start, end = outcome(runs, f"{config}-async", 0)["slowed"]
    assert SLOWED[config] <= start <= end == SLOWED[config] + 2, "no training during the write"
    sync_dir, async_dir = (runs / f"{config}-{how}" / "checkpoints" for how in ("sync", "async"))
    entries = manifest(sync_dir)
    assert [e["step"] for e in manifest(async_dir)] == [e["step"] for e in entries]
    assert SLOWED[config] in [e["step"] for e in entries]
    for entry in entries:
        name = entry["file"]
        assert_equal(load(async_dir / name), load(sync_dir / name), name)
    modes = {p.relative_to(sync_dir): p.stat().st_mode for p in sync_dir.rglob("*")}
    assert {p.relative_to(async_dir): p.stat().st_mode for p in async_dir.rglob("*")} == modes
    assert not list(async_dir.glob(".tmp-*"))


@pytest.mark.parametrize(
    "config, step, error_step, left",
    [
        pytest.param("plain", 4, 6, "step-00000002.pt", id="ddp-file"),
        pytest.param("fsdp", 4, 5, "step-00000002", id="fsdp-shards"),
    ],
)
def test_a_full_disk_under_async_fails_every_rank_alike(
    runs: Path, tmpfs: Path | None, config: str, step: int, error_step: int, left: str
) -> None:
    """The write of update ``step`` fails on the full disk: every rank raises the synchronous
    path's one-line error at the next checkpoint (``error_step``); the previous checkpoint
    stays, the newest in the manifest, and no temp file does."""
    if tmpfs is None:
        pytest.skip("mounting a tmpfs needs root here")
    outcomes = [outcome(runs, f"{config}-full", rank) for rank in range(2)]
    assert outcomes[0] == outcomes[1], f"the ranks disagree: {outcomes}"
    error, checkpoints = str(outcomes[0]["error"]), tmpfs / config / "checkpoints"
    failed = checkpoints / (f"step-{step:08d}" + (".pt" if config == "plain" else ""))
    assert error.startswith(f"OSError: could not write the checkpoint {failed} (about "), error
    assert " MiB of tensors): no space left on its filesystem (" in error
    assert "then train(resume='auto') continues from the newest intact checkpoint" in error
    assert "\n" not in error
    assert outcomes[0]["step"] == error_step
    assert sorted(os.listdir(checkpoints)) == ["manifest.json", left]
    assert [entry["file"] for entry in manifest(checkpoints)] == [left]


def updates(out: Path, name: str, rank: int, attempt: int) -> list[dict[str, Any]]:
    path = out / f"{name}-{attempt}.rank{rank}.ids.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_resumed_as_straight(
    runs: Path, out: Path, name: str, config: str, attempt: int, resumed: int
) -> None:
    """Attempt ``attempt + 1`` of ``name`` resumed from update ``resumed`` and ended with the
    straight run's parameters on every rank, bit for bit, having trained the same samples to
    the same loss."""
    for rank in range(2):
        got = outcome(out, name, rank, attempt + 1)
        assert got["start_step"] == resumed
        assert got["final"] == outcome(runs, f"{config}-sync", rank)["final"], f"rank {rank}"
        stream = [u for u in updates(out, name, rank, attempt) if u["step"] <= resumed]
        stream += updates(out, name, rank, attempt + 1)
        assert stream == updates(runs, f"{config}-sync", rank, 0), f"rank {rank}"


def test_a_kill_or_sigterm_during_an_async_write(runs: Path, tmp_path: Path) -> None:
    """One torchrun job, restarted by torchrun after each fault. Rank 0 is SIGKILLed in the
    middle of writing update A's checkpoint (half its file written), plain then fsdp: each
    resumes from update B's, the newest complete one. Then SIGTERM after update 7, while
    update 6's checkpoint is written slowly: the pre-emption checkpoint (update 8) waits for
    it, is written whole, and the run resumes from it. Each ends as the straight run."""
    cases = [
        {"name": f"{config}-kill", "config": config, "async": True, "at": KILLED[config][0]}
        for config in CONFIGS
    ]
    for case in cases:
        case.update(kill=True, slow=0.3)
    cases.append({"name": "sigterm", "config": "plain", "async": True, "at": 6, "slow": 0.5})
    cases[-1]["sigterm"] = 7
    options = ["--master-addr=127.0.0.1", f"--master-port={free_port()}", "--nnodes=1"]
    args = [write_cases(tmp_path, cases), str(tmp_path)]
    command = torchrun_command(WORKER, 2, args, [*options, "--max-restarts=3"])
    (result,) = run_together([Launch(command)], timeout=360)
    assert result.returncode == 0, result.describe()
    assert result.output.count("exitcode: -9") == 2, result.describe()  # SIGKILL, twice
    assert "pre-empted: checkpoint written at step 8" in result.output, result.describe()
    resume_path = tmp_path / "sigterm" / "checkpoints" / "step-00000008.pt"
    # update 8 is also a checkpoint's (every 2): written once, not again for the pre-emption
    assert result.output.count(f"checkpoint written: {resume_path}") == 1, result.describe()
    assert f"resumed from {resume_path}" in result.output, result.describe()
    assert_resumed_as_straight(runs, tmp_path, "sigterm", "plain", 2, 8)
    for attempt, config in enumerate(CONFIGS):
        killed, resumed = KILLED[config]
        checkpoints = tmp_path / f"{config}-kill" / "checkpoints"
        resume_path = checkpoints / (f"step-{resumed:08d}" + (".pt" if config == "plain" else ""))
        assert f"resumed from {resume_path}" in result.output, result.describe()
        done = updates(tmp_path, f"{config}-kill", 0, attempt)
        assert done[-1]["step"] > killed, "training stopped for the write"
        assert_resumed_as_straight(runs, tmp_path, f"{config}-kill", config, attempt, resumed)
    # Each kill left its temp (the half-written file of update 6, the shards' folder of update
    # 4); the resume removed it, once the ranks agreed on the checkpoint, and said so in a line.
    removed = "removed 1 temp(s) of checkpoint writes that were killed"
    for config, temp in (
        ("plain", r"\.tmp-[0-9a-f]{32}-step-00000006\.pt"),
        ("fsdp", r"\.tmp-step-00000004"),
    ):
        checkpoints = tmp_path / f"{config}-kill" / "checkpoints"
        assert not list(checkpoints.glob(".tmp-*")), sorted(os.listdir(checkpoints))
        where = re.escape(str(checkpoints))
        line = rf"{re.escape(removed)} \([0-9.]+ [KMG]iB\) from {where}: {temp}\n"
        assert len(re.findall(line, result.output)) == 1, result.describe()
