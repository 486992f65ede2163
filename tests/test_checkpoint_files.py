"""Checkpoint files in one process, with real files: their modes, the checksums of every file
of a sharded checkpoint, what a later run may do with an earlier run's checkpoints, and the
errors that name a file the user gave. (The same on 2 ranks: tests/test_resume.py.)

The trainer is tests/inprocess.py's: 24 samples in batches of 4, 6 updates an epoch.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import stat
import threading
import zlib
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pytest
import torch
from inprocess import make_trainer

from fastdist import DistTrainer
from fastdist.callbacks import Callback
from fastdist.checkpoint.files import CheckpointDir, atomic_file, atomic_save
from fastdist.checkpoint.lock import LOCK_FILE

pytestmark = pytest.mark.usefixtures("no_dist_env")


def trainer(save_path: Path | None, **kwargs: Any) -> DistTrainer:
    """The in-process trainer, saving under ``save_path`` (if given)."""
    path = None if save_path is None else str(save_path)
    return make_trainer(Callback(), save_path=path, **kwargs)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, with its bytes; not the lock file a
    run with this ``checkpoint_dir`` leaves (its holder's pid)."""
    files = (p for p in directory.rglob("*") if p.is_file() and p.name != LOCK_FILE)
    return {str(path.relative_to(directory)): path.read_bytes() for path in files}


def manifest(checkpoints: Path) -> list[dict[str, Any]]:
    return json.loads((checkpoints / "manifest.json").read_text())


def flip_a_byte(path: Path) -> None:
    """Corrupt ``path`` in the middle, as a bad disk would: its size stays."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


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


def test_a_fresh_start_never_deletes_earlier_checkpoints(tmp_path: Path) -> None:
    """resume=False, or a checkpoint from elsewhere, where checkpoints are is refused before
    training and changes nothing; continuing from the newest is allowed, and then the run's
    pruning covers them. (An older one: see the rollback test below.)"""
    trainer(tmp_path, checkpoint_every=2).train()
    checkpoints = tmp_path / "checkpoints"
    assert [entry["step"] for entry in manifest(checkpoints)] == [4, 6]
    before = snapshot(checkpoints)
    holds = rf"the checkpoint directory '{checkpoints}' already holds checkpoints"
    fixes = r"continue them with train\(resume='auto'\), use another save_path/checkpoint_dir, "
    fixes += "or delete the old checkpoints yourself"
    with pytest.raises(FileExistsError, match=rf"{holds} \(step-00000004.pt, step-00000006.pt\)"):
        trainer(tmp_path).train(resume=False)
    with pytest.raises(FileExistsError, match=rf"fresh start \(resume=False\) would .*: {fixes}"):
        trainer(None, checkpoint_dir=str(checkpoints)).train(resume=False)
    (checkpoints / "manifest.json").rename(tmp_path / "manifest.json")
    with pytest.raises(FileExistsError, match=holds):  # step-* files without a manifest
        trainer(tmp_path).train(resume=False)
    (tmp_path / "manifest.json").rename(checkpoints / "manifest.json")

    trainer(tmp_path / "other").train()
    elsewhere = tmp_path / "other" / "checkpoints" / "step-00000006.pt"
    with pytest.raises(FileExistsError, match=rf"which a run resumed from '{elsewhere}' would"):
        trainer(tmp_path).train(resume=str(elsewhere))
    assert snapshot(checkpoints) == before

    continued = trainer(tmp_path, checkpoint_every=2, n_epochs=2)
    assert continued.train(resume=str(checkpoints / "step-00000006.pt"))["steps"] == 12
    assert [entry["step"] for entry in manifest(checkpoints)] == [10, 12]
    assert sorted(path.name for path in checkpoints.glob("step-*")) == [
        "step-00000010.pt",
        "step-00000012.pt",
    ]


class CountUpdates(Callback):
    def __init__(self) -> None:
        self.updates = 0

    def on_step_end(self) -> None:
        self.updates += 1


@pytest.mark.parametrize("manifest_left", ["older entries", "none"])
def test_an_unrecorded_newest_checkpoint_is_resumed_not_overwritten(
    tmp_path: Path, manifest_left: str
) -> None:
    """A run stopped between writing a checkpoint (renamed whole) and recording it in the
    manifest: resume='auto' continues from it (it trained update 6 already), and does not
    start over and write a new step-00000006.pt over it."""
    trainer(tmp_path, checkpoint_every=2).train()
    checkpoints = tmp_path / "checkpoints"
    entries = manifest(checkpoints)
    if manifest_left == "none":
        (checkpoints / "manifest.json").unlink()
    else:
        (checkpoints / "manifest.json").write_text(json.dumps(entries[:-1]))  # 6 unrecorded
    saved = (checkpoints / "step-00000006.pt").read_bytes()
    counter = CountUpdates()
    result = make_trainer(counter, save_path=str(tmp_path), checkpoint_every=4, n_epochs=2).train()
    assert result["steps"] == 12 and counter.updates == 6  # from update 6 on
    assert (checkpoints / "step-00000006.pt").read_bytes() == saved  # never rewritten


def test_an_unrecorded_sharded_checkpoint_missing_a_shard_is_skipped(tmp_path: Path) -> None:
    """An unlisted sharded checkpoint (no checksums) with a shard gone: named in a warning and
    skipped, as a listed one whose checksums fail; the run resumes from the one before."""
    trainer(tmp_path, checkpoint_every=2, strategy="fsdp").train()
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "manifest.json").write_text(json.dumps(manifest(checkpoints)[:-1]))
    shard = next((checkpoints / "step-00000006").glob("*.distcp"))
    shard.unlink()
    counter = CountUpdates()
    make_trainer(
        counter, save_path=str(tmp_path), checkpoint_every=2, n_epochs=2, strategy="fsdp"
    ).train()
    assert counter.updates == 8  # from update 4 on


def test_an_unrecorded_garbage_checkpoint_is_skipped_in_one_line_and_set_aside(
    tmp_path: Path, log_lines: list[str]
) -> None:
    """Random bytes as a newer, unlisted step file: skipped with torch's first line only (it
    quoted torch's whole advice: "Re-running torch.load ... Please file an issue"), moved
    aside byte for byte, and the run resumes from update 6."""
    trainer(tmp_path, checkpoint_every=2).train()
    checkpoints = tmp_path / "checkpoints"
    garbage = os.urandom(40_000)
    (checkpoints / "step-00000008.pt").write_bytes(garbage)
    counter = CountUpdates()
    make_trainer(counter, save_path=str(tmp_path), checkpoint_every=2, n_epochs=2).train()
    assert counter.updates == 6  # from update 6 on
    skipped = [line for line in log_lines if "skipping checkpoint" in line]
    assert len(skipped) == 1 and "\n" not in skipped[0] and "file an issue" not in skipped[0]
    assert skipped[0].endswith("(not in the manifest: cut short?)"), skipped[0]
    (aside,) = tmp_path.glob("checkpoints-set-aside-*")
    assert (aside / "step-00000008.pt").read_bytes() == garbage


def test_ctrl_c_inside_a_checkpoint_write_stays_a_keyboard_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT while torch writes the tensors: its writer then fails to close ("unexpected
    pos"), raised while the KeyboardInterrupt was handled. That came out as "could not write
    the checkpoint ...: free space" with a traceback; it is the interrupt, and no temp stays."""

    def interrupted(obj: Any, f: Any) -> None:
        f.write(b"partial")
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6144")  # noqa: B904 (as torch: chained implicitly)

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_save({"w": torch.zeros(4)}, str(tmp_path / "step-00000001.pt"))
    assert list(tmp_path.iterdir()) == []


def test_pruning_removes_only_the_runs_own_checkpoints(tmp_path: Path) -> None:
    """A run prunes what it wrote and what it continues, never another run's checkpoint."""
    CheckpointDir(str(tmp_path), keep=1).save({"run": 1}, 1)
    later = CheckpointDir(str(tmp_path), keep=1)
    for step in (2, 3):
        later.save({"run": 2}, step)
    assert [entry["step"] for entry in manifest(tmp_path)] == [1, 3]
    assert sorted(path.name for path in tmp_path.glob("step-*")) == [
        "step-00000001.pt",
        "step-00000003.pt",
    ]
    later.adopt(["step-00000001.pt"])  # as when it continues them
    later.save({"run": 2}, 4)
    assert [entry["step"] for entry in manifest(tmp_path)] == [4]
    assert [path.name for path in tmp_path.glob("step-*")] == ["step-00000004.pt"]


def test_every_file_of_a_sharded_checkpoint_is_checksummed(
    tmp_path: Path, log_lines: list[str]
) -> None:
    """The manifest holds the CRC-32 of every file of a sharded checkpoint. A corrupt shard
    makes resume='auto' fall back to the checkpoint before, with a warning naming it, and a
    resume from it by name an error naming it. Entries of before (``trainer.pt``'s CRC-32
    only) still resume."""
    trainer(tmp_path / "run", strategy="fsdp", checkpoint_every=3).train()
    checkpoints = tmp_path / "run" / "checkpoints"
    for entry in manifest(checkpoints):
        files = (checkpoints / entry["file"]).iterdir()
        assert entry["files"] == {path.name: zlib.crc32(path.read_bytes()) for path in files}
        assert entry["crc32"] == entry["files"]["trainer.pt"]
    assert set(entry["files"]) == {".metadata", "__0_0.distcp", "trainer.pt"}

    old = tmp_path / "old" / "checkpoints"
    shutil.copytree(checkpoints, old)
    entries = [{k: v for k, v in entry.items() if k != "files"} for entry in manifest(old)]
    (old / "manifest.json").write_text(json.dumps(entries))
    assert trainer(old.parent, strategy="fsdp", n_epochs=2).train()["steps"] == 12
    assert any(f"resumed from {old / 'step-00000006'}:" in line for line in log_lines)

    shard = checkpoints / "step-00000006" / "__0_0.distcp"
    flip_a_byte(shard)
    named = rf"resume='{shard.parent}' cannot be resumed from: {shard}: its CRC-32 does not"
    with pytest.raises(ValueError, match=named):
        trainer(tmp_path / "new", strategy="fsdp").train(resume=str(shard.parent))
    log_lines.clear()
    assert trainer(checkpoints.parent, strategy="fsdp", n_epochs=2).train()["steps"] == 12
    skipped = f"WARNING skipping checkpoint {shard.parent}: {shard}: its CRC-32 does not match"
    assert any(line.startswith(skipped) for line in log_lines), log_lines
    assert any(f"resumed from {checkpoints / 'step-00000003'}:" in line for line in log_lines)


@pytest.mark.parametrize(
    "content, why",
    [
        pytest.param('[{"file": "step-00000003.pt", ', "invalid JSON", id="cut-short"),
        pytest.param('{"file": "step-00000003.pt"}', "it is not a list of", id="not-a-list"),
        pytest.param(
            '[{"file": "../../x", "crc32": 1, "step": 3}]', "it is not a list of", id="a-path"
        ),
    ],
)
def test_a_broken_manifest_is_an_error_naming_it(tmp_path: Path, content: str, why: str) -> None:
    """Whether the run would resume (auto) or start afresh (False): a manifest that is not
    one is an error, not a silent fresh start or a failure at the first checkpoint."""
    path = tmp_path / "checkpoints" / "manifest.json"
    path.parent.mkdir()
    path.write_text(content)
    for resume in ("auto", False):
        with pytest.raises(ValueError, match=rf"{path} is not a checkpoint manifest \({why}"):
            trainer(tmp_path).train(resume=resume)
    assert path.read_text() == content


def test_a_file_given_as_resume_that_is_not_a_checkpoint_is_named(tmp_path: Path) -> None:
    trainer(tmp_path / "run").train()
    good = (tmp_path / "run" / "checkpoints" / "step-00000006.pt").read_bytes()
    truncated, garbage = tmp_path / "truncated.pt", tmp_path / "garbage.pt"
    truncated.write_bytes(good[: len(good) // 2])
    garbage.write_bytes(b"\x00" * 100)
    for path in (truncated, garbage):
        with pytest.raises(ValueError, match=rf"resume='{path}' cannot be resumed from: "):
            trainer(None).train(resume=str(path))
    missing = tmp_path / "nowhere.pt"
    with pytest.raises(FileNotFoundError, match=rf"resume='{missing}': no such checkpoint"):
        trainer(None).train(resume=str(missing))
    with pytest.raises(ValueError, match=r"resume=True: pass 'auto', a checkpoint's path, or"):
        trainer(None).train(resume=True)


def test_runs_sharing_save_path_in_one_second_keep_both_best_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs in one ``save_path`` (each its own checkpoint_dir) whose first best evaluation
    falls in the same second (the clock held there): the second run's best model gets a name of
    its own, and the first run's file keeps its bytes."""
    monkeypatch.setattr("time.strftime", lambda *args: "2026-11-25-12-00-00")
    trainer(tmp_path, checkpoint_dir=str(tmp_path / "a")).train()
    name = "best_Linear_acc_2026-11-25-12-00-00"
    kept = (tmp_path / f"{name}.pt").read_bytes()
    trainer(tmp_path, checkpoint_dir=str(tmp_path / "b"), batch_size_per_gpu=2).train()
    assert sorted(p.name for p in tmp_path.glob("best_*")) == [f"{name}-2.pt", f"{name}.pt"]
    assert (tmp_path / f"{name}.pt").read_bytes() == kept
    first_weights, second_weights = (
        torch.load(tmp_path / f"{stem}.pt", weights_only=True) for stem in (name, f"{name}-2")
    )
    assert not torch.equal(first_weights["fc.weight"], second_weights["fc.weight"])


def test_a_rollback_in_place_sets_the_newer_checkpoints_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list[str]
) -> None:
    """resume=<an older checkpoint of the directory> moves the newer ones, with their manifest
    entries, into a sibling directory named for the time, logs where, and trains on from the
    older one. A second rollback in the same second (the clock held there) gets a directory of
    its own, and the checkpoints set aside resume from there."""
    monkeypatch.setattr("time.strftime", lambda *args: "2026-11-25-12-00-00")
    checkpoints = tmp_path / "checkpoints"
    trainer(tmp_path, checkpoint_every=2).train()
    asides = [tmp_path / f"checkpoints-set-aside-2026-11-25-12-00-00{n}" for n in ("", "-2")]
    for aside in asides:
        newest = snapshot(checkpoints)["step-00000006.pt"]
        log_lines.clear()
        result = trainer(tmp_path, checkpoint_every=2).train(
            resume=checkpoints / "step-00000004.pt"
        )
        assert result["steps"] == 6
        moved = (
            f"the 1 newer checkpoint(s) of {checkpoints} (step-00000006.pt) were moved to {aside}"
        )
        assert any(
            line.startswith("WARNING rolling back to") and moved in line for line in log_lines
        )
        assert snapshot(aside) == {"step-00000006.pt": newest, "manifest.json": ANY}
        assert [entry["step"] for entry in manifest(aside)] == [6]
        assert [entry["step"] for entry in manifest(checkpoints)] == [4, 6]
    assert sorted(p.name for p in tmp_path.glob("checkpoints*")) == [
        "checkpoints",
        *(aside.name for aside in asides),
    ]
    back = trainer(None, checkpoint_dir=str(asides[0]), n_epochs=2).train()
    assert back["steps"] == 12
    assert any(f"resumed from {asides[0] / 'step-00000006.pt'}:" in line for line in log_lines)


def test_a_rollback_to_a_corrupt_checkpoint_moves_nothing(
    tmp_path: Path, log_lines: list[str]
) -> None:
    """resume=<an older checkpoint of the directory> whose checksum fails: a one-line error
    naming it, before anything is set aside; resume='auto' then continues from the newest."""
    checkpoints = tmp_path / "checkpoints"
    trainer(tmp_path, checkpoint_every=2).train()
    flip_a_byte(checkpoints / "step-00000004.pt")
    before = snapshot(checkpoints)
    with pytest.raises(ValueError) as raised:
        trainer(tmp_path, checkpoint_every=2).train(resume=checkpoints / "step-00000004.pt")
    assert str(raised.value).startswith(
        f"resume={str(checkpoints / 'step-00000004.pt')!r} cannot be resumed from: "
        f"{checkpoints / 'step-00000004.pt'}: its CRC-32 does not match the manifest"
    )
    assert snapshot(checkpoints) == before
    assert not list(tmp_path.glob("checkpoints-set-aside-*"))
    assert "(nothing was moved)" in str(raised.value)
    log_lines.clear()
    assert trainer(tmp_path, checkpoint_every=2, n_epochs=2).train()["steps"] == 12
    assert any(f"resumed from {checkpoints / 'step-00000006.pt'}:" in line for line in log_lines)


def test_a_manifest_that_cannot_be_written_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the manifest's write (after the checkpoint's): one line naming the
    manifest, the unrecorded checkpoint and the fix (was a bare 'No space left on device')."""
    import errno

    from fastdist.checkpoint import files

    def full(directory: str, entries: list[dict[str, Any]]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_write_manifest", full)
    with pytest.raises(OSError) as raised:
        CheckpointDir(str(tmp_path), keep=1).save({"run": 1}, 2)
    message = str(raised.value)
    assert message.startswith(f"could not write the manifest {tmp_path / 'manifest.json'}: ")
    assert "no space left on its filesystem" in message
    assert "step-00000002.pt is not recorded; free space" in message


def _killed_mid_write(path: Path) -> None:
    """A child process writes ``path`` and is killed before the fsync and the rename."""
    pid = os.fork()
    if pid == 0:  # the child: nothing but the write, then SIGKILL
        with atomic_file(str(path)) as f:
            f.write(b"x" * 100_000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL


def test_a_start_removes_the_temps_of_killed_writes_and_nothing_else(
    tmp_path: Path, log_lines: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed while it writes a checkpoint leaves its temp, full size; a stale
    sharded temp folder too. The next start (here a fresh one) removes both, says so in one
    line (in KiB), names in a warning the one it cannot remove, and leaves the temps of a live
    writer (a thread here), a temp's name on the wrong kind and every other file alone."""
    checkpoints = tmp_path / "save" / "checkpoints"
    checkpoints.mkdir(parents=True)
    _killed_mid_write(checkpoints / "step-00000003.pt")
    (checkpoints / ".tmp-step-00000004").mkdir()  # a sharded write's, killed
    (checkpoints / ".tmp-step-00000004" / "__0_0.distcp").write_bytes(b"y" * 5000)
    users = [".tmp-notes.txt", ".tmp-0123-step-00000005.pt", "step-3.pt.tmp", ".tmp-step-x"]
    for name in users:
        (checkpoints / name).write_text("the user's")
    # names of temps, not their kind: a folder named as a .pt temp, a file as a sharded one
    (checkpoints / f".tmp-{'a' * 32}-step-00000006.pt").mkdir()
    (checkpoints / ".tmp-step-00000007").write_text("the user's")
    users += [f".tmp-{'a' * 32}-step-00000006.pt", ".tmp-step-00000007"]
    stuck = f".tmp-{'b' * 32}-manifest.json"  # a killed write's, that cannot be removed
    (checkpoints / stuck).write_text("[]")
    remove = os.remove

    def refused(path: str | os.PathLike[str]) -> None:
        if str(path).endswith(stuck):
            raise PermissionError(1, "Operation not permitted", str(path))
        remove(path)

    monkeypatch.setattr(os, "remove", refused)  # as for an immutable file (chattr +i)
    live_dir = checkpoints / ".tmp-step-00000010"  # a sharded write's, live: locked
    live_dir.mkdir()
    held = os.open(live_dir, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as its writer holds it
    writing, done = threading.Event(), threading.Event()

    def write() -> None:
        with atomic_file(str(checkpoints / "step-00000009.pt")):
            writing.set()
            done.wait(60)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert writing.wait(60)
        before = sorted(os.listdir(checkpoints))
        (stale,) = [n for n in before if n.endswith("-step-00000003.pt")]
        (live,) = [n for n in before if n.endswith("-step-00000009.pt")]
        assert (checkpoints / stale).stat().st_size == 100_000
        trainer(tmp_path / "save", n_epochs=1).train()
        left = sorted(n for n in os.listdir(checkpoints) if "tmp" in n)
        assert left == sorted([*users, live_dir.name, live, stuck])
        removed = [line for line in log_lines if "temp(s)" in line]
        assert removed == [
            f"INFO removed 2 temp(s) of checkpoint writes that were killed (103 KiB) from "
            f"{checkpoints}: {stale}, .tmp-step-00000004",
            f"WARNING could not remove 1 temp(s) of checkpoint writes that were killed from "
            f"{checkpoints}: {stuck} (Operation not permitted); remove them yourself (they take "
            "disk space)",
        ]
    finally:
        done.set()
        writer.join(60)
        os.close(held)
