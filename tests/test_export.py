"""``python -m fastdist export`` on checkpoints it must not trust or must not touch: corrupt
ones (checked as a resume checks them), an OUT inside the checkpoint directory, files that are
no checkpoint, a truncated shard. In one process, with real files.

The trainer is tests/inprocess.py's: 24 samples in batches of 4, 6 updates an epoch.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from inprocess import make_trainer

from fastdist.callbacks import Callback
from fastdist.cli import main

pytestmark = pytest.mark.usefixtures("no_dist_env")


def checkpoints_of(save_path: Path, **kwargs: object) -> Path:
    """Train the in-process trainer with checkpoints at steps 3 and 6; their directory."""
    make_trainer(Callback(), save_path=str(save_path), checkpoint_every=3, **kwargs).train()
    return save_path / "checkpoints"


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def export(
    checkpoint: Path, out: Path, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, str]:
    """Run the command; its exit code and its message, which must be its output's last line
    and one line (the lines before: training's log, export's warnings)."""
    capsys.readouterr()
    code = main(["export", str(checkpoint), str(out), *flags])
    captured = capsys.readouterr()
    message = (captured.err if code else captured.out).rstrip("\n").splitlines()[-1]
    assert message.startswith("fastdist export: " if code else "wrote "), captured
    return code, message


def test_export_verifies_the_checksums_as_resume_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], log_lines: list[str]
) -> None:
    """8 corrupted bytes: the file named is refused, naming the mismatch; the directory's
    newest checkpoint that verifies is exported instead, with a warning naming the bad one."""
    checkpoints = checkpoints_of(tmp_path / "run")
    newest = checkpoints / "step-00000006.pt"
    weight = torch.load(newest, weights_only=True)["parts"]["model"]["fc.weight"]
    data = newest.read_bytes()
    at = data.index(weight.numpy().tobytes())  # 8 bytes of the weights: torch.load cannot tell
    newest.write_bytes(data[:at] + bytes(b ^ 0x5A for b in data[at : at + 8]) + data[at + 8 :])

    code, message = export(newest, tmp_path / "m.pt", capsys)
    assert code == 1
    assert f"{newest} cannot be exported: {newest}: its CRC-32 does not match" in message
    assert not (tmp_path / "m.pt").exists()

    code, message = export(checkpoints, tmp_path / "m.pt", capsys)
    assert code == 0, message
    assert f"the model of {checkpoints / 'step-00000003.pt'}" in message
    assert any(f"skipping checkpoint {newest}: {newest}: its CRC-32" in line for line in log_lines)
    older = torch.load(checkpoints / "step-00000003.pt", weights_only=True)
    exported = torch.load(tmp_path / "m.pt", weights_only=True)
    assert exported.keys() == older["parts"]["model"].keys()
    assert all(torch.equal(exported[k], older["parts"]["model"][k]) for k in exported)


def test_export_refuses_an_out_inside_the_checkpoint_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest, another checkpoint's file, a shard of another sharded checkpoint, or
    any of them through a link: refused, and not a byte of the directory changes."""
    plain = checkpoints_of(tmp_path / "ddp")
    sharded = checkpoints_of(tmp_path / "fsdp", strategy="fsdp")
    (tmp_path / "link").symlink_to(sharded)
    before = snapshot(tmp_path / "ddp"), snapshot(tmp_path / "fsdp")
    cases = [
        (plain / "step-00000006.pt", plain / "manifest.json"),
        (plain / "step-00000006.pt", plain / "step-00000003.pt"),
        (plain, plain / "new.pt"),
        (sharded / "step-00000006", sharded / "step-00000003" / "__0_0.distcp"),
        (sharded / "step-00000006", tmp_path / "link" / "step-00000003" / "trainer.pt"),
        (tmp_path / "link", sharded / "manifest.json"),
    ]
    for checkpoint, out in cases:
        code, message = export(checkpoint, out, capsys)
        assert code == 1, (checkpoint, out)
        assert f"OUT={str(out)!r} lies in the checkpoint directory" in message, message
        assert "pass a path outside it" in message
    assert (snapshot(tmp_path / "ddp"), snapshot(tmp_path / "fsdp")) == before
    code, message = export(tmp_path / "link", tmp_path / "m.pt", capsys)  # outside: written
    assert code == 0, message


def test_export_refuses_an_out_in_another_runs_checkpoints_or_an_existing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another run's checkpoint file, its manifest, a new file beside them, a file in a
    rollback's set-aside directory: refused, not a byte changed. An existing file elsewhere:
    replaced only with --overwrite."""
    source = checkpoints_of(tmp_path / "a")
    other = checkpoints_of(tmp_path / "b")
    aside = tmp_path / "b" / "checkpoints-set-aside-2026-01-01-00-00-00"
    aside.mkdir()
    os.replace(other / "step-00000003.pt", aside / "step-00000003.pt")
    (aside / "manifest.json").write_text("[]")
    before = snapshot(tmp_path / "b")
    for out in [
        other / "step-00000006.pt",
        other / "manifest.json",
        other / "new.pt",
        aside / "step-00000003.pt",
        aside / "manifest.json",
    ]:
        code, message = export(source, out, capsys)
        assert code == 1, out
        assert f"OUT={str(out)!r} lies in the checkpoint directory" in message, message
    assert snapshot(tmp_path / "b") == before

    (tmp_path / "m.pt").write_bytes(b"the user's")
    code, message = export(source, tmp_path / "m.pt", capsys)
    assert code == 1
    assert f"OUT={str(tmp_path / 'm.pt')!r} exists already" in message, message
    assert "--overwrite to replace it" in message
    assert (tmp_path / "m.pt").read_bytes() == b"the user's"
    code, message = export(source, tmp_path / "m.pt", capsys, "--overwrite")
    assert code == 0, message
    assert torch.load(tmp_path / "m.pt", weights_only=True).keys() == {"fc.weight", "fc.bias"}


def test_export_names_the_file_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A text file, a cut-short checkpoint file, a truncated shard (of a sharded checkpoint
    whose manifest entry predates the shards' checksums): one line naming the file and the
    fix, never torch's advice to load with weights_only=False."""
    notes = tmp_path / "notes.txt"
    notes.write_text("lr=0.1\nbatch=4\n")
    code, message = export(notes, tmp_path / "m.pt", capsys)
    assert code == 1
    assert f"{notes} is not a checkpoint: torch.load cannot read it" in message, message
    assert "pass a step-* file or directory fastdist wrote" in message
    assert "weights_only=False" not in message

    checkpoints = checkpoints_of(tmp_path / "fsdp", strategy="fsdp")
    entries = [
        {k: v for k, v in e.items() if k != "files"}
        for e in json.loads((checkpoints / "manifest.json").read_text())
    ]
    (checkpoints / "manifest.json").write_text(json.dumps(entries))
    shard = checkpoints / "step-00000006" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    code, message = export(shard.parent, tmp_path / "m.pt", capsys)
    assert code == 1
    assert f"{shard} is truncated or missing: {size // 2} bytes where the checkpoint's" in message
    assert "export an earlier checkpoint of its directory" in message
    # A sharded checkpoint with no manifest beside it whose .metadata is cut short or empty,
    # and a checkpoint file cut short anywhere (an audit: a traceback, and "[Errno 22] Invalid
    # argument" naming no file).
    lone = tmp_path / "lone" / "step-00000006"
    shutil.copytree(shard.parent, lone)
    for size in (20, 0):
        os.truncate(lone / ".metadata", size)
        code, message = export(lone, tmp_path / "m.pt", capsys)
        assert code == 1 and f"{lone / '.metadata'} cannot be read (" in message, message
    whole = checkpoints_of(tmp_path / "ddp") / "step-00000006.pt"
    cut = tmp_path / "cut.pt"
    for eighths in range(1, 8):
        cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * eighths // 8])
        code, message = export(cut, tmp_path / "m.pt", capsys)
        assert code == 1 and message.startswith(f"fastdist export: {cut} "), message


@pytest.mark.parametrize(
    "content, words",
    [
        ([1, 2], ": it holds a list"),
        (torch.ones(2), ": it holds a Tensor"),
        ({1: torch.ones(2)}, ""),
        ({}, ": it is an empty dict"),
    ],
)
def test_export_names_a_torch_file_that_holds_no_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, words: str
) -> None:
    """torch.save files of other things: one line, not a traceback nor an empty model."""
    path = tmp_path / "other.pt"
    torch.save(content, path)
    code, message = export(path, tmp_path / "m.pt", capsys)
    assert code == 1 and not (tmp_path / "m.pt").exists()
    neither = f"{path} is not a checkpoint fastdist wrote, nor a state_dict (names to tensors)"
    assert message.endswith(neither + words), message
