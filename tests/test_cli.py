"""``python -m fastdist``: ``env`` (in-process and as real processes) and ``plot``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launch import free_port, run_python, run_torchrun

import fastdist
from fastdist.cli import main
from fastdist.cli.env import check_process_group, report
from fastdist.cli.plot import figure, load_run, run_names

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_log(path: Path, runs: list[dict[str, Any]]) -> Path:
    """Write synthetic JSONLogCallback runs: each ``{"n": steps, "scale": loss scale}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for spec in runs:
        lines.append({"kind": "start", "step": 0, "epoch": 0, "time": 0.0, "world_size": 2})
        for step in range(2, spec["n"] + 1, 2):
            loss = spec["scale"] / step
            lines.append({"kind": "train", "step": step, "epoch": 1, "loss": loss, "lr": 0.1,
                          "time": step * 0.5, "samples_per_s": 100.0 + step})  # fmt: skip
            if step % 4 == 0:
                lines.append({"kind": "eval", "step": step, "epoch": 1, "time": step * 0.5,
                              "is_better": True, "acc": 1 - loss / 10, "f1": 0.5})  # fmt: skip
        lines.append({"kind": "end", "step": spec["n"], "best_eval": None, "steps": spec["n"]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_plot_two_runs_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # installed with fastdist[dev] / fastdist[plot]
    write_log(tmp_path / "a" / "save" / "log.jsonl", [{"n": 20, "scale": 2.0}])
    b = write_log(tmp_path / "b" / "save" / "log.jsonl", [{"n": 30, "scale": 3.0}])
    out = tmp_path / "figs" / "curves.png"
    # A RUN is a directory holding log.jsonl or the log file itself.
    assert main(["plot", str(tmp_path / "a" / "save"), str(b), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 20_000, "a figure with curves, not an empty canvas"
    assert "2 run(s): a/save, b/save" in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the default output is ./curves.png
    log = write_log(tmp_path / "log.jsonl", [{"n": 4, "scale": 1.0}])
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["plot", str(log)]) == 1
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and "fastdist[plot]" in err
    assert not (tmp_path / "curves.png").exists()


def test_plot_reports_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")]) == 1
    assert "nope: no such log file" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("\n")
    assert main(["plot", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "x.png")]) == 1
    assert "no records" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plot_names_a_bad_input_or_output_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"\x80\x02\xff\xfe binary")
    assert main(["plot", str(binary), "-o", str(tmp_path / "x.png")]) == 1
    assert f"{binary} is not a text log (invalid start byte)" in capsys.readouterr().err
    log = write_log(tmp_path / "log.jsonl", [{"n": 4, "scale": 1.0}])
    for out in (tmp_path, log / "x.png"):  # a directory; under a file
        assert main(["plot", str(log), "-o", str(out)]) == 1
        assert f"fastdist plot: cannot write {out}: " in capsys.readouterr().err
    notes = tmp_path / "notes.txt"  # nothing saved is written over: an input, a non-PNG
    notes.write_text("keep me")
    for out, words in ((log, "is a log it reads"), (notes, "exists and is not a PNG")):
        assert main(["plot", str(log), "-o", str(out)]) == 1
        assert f"-o {out} {words}: pass" in capsys.readouterr().err
    assert notes.read_text() == "keep me" and log.read_text().startswith("{")
    for dpi in ("0", "100000"):
        with pytest.raises(SystemExit) as exit_:
            main(["plot", str(log), "--dpi", dpi, "-o", str(tmp_path / "x.png")])
        assert exit_.value.code == 2
        assert f"must be from 1 to 1200, got {dpi}" in capsys.readouterr().err


def test_load_run_replaces_earlier_runs_and_skips_a_cut_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "log.jsonl", [{"n": 4, "scale": 1.0}, {"n": 8, "scale": 2.0}])
    with log.open("a") as f:
        f.write('{"kind": "train", "st')  # a crash mid-line
    records = load_run(log)
    assert records[0]["kind"] == "start" and records[-1]["kind"] == "end"
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6, 8]
    err = capsys.readouterr().err
    assert "holds 2 runs; joined them" in err and "skipped 1 line" in err


def test_plot_joins_a_killed_run_and_its_resume(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ranks = [{"rank": 0, "update_ms": 5.0}, {"rank": 1, "update_ms": 7.0}]

    def train(step: int, lr: float, part: str) -> dict[str, Any]:
        return {"kind": "train", "step": step, "loss": 1 / step, "lr": lr, "part": part,
                "ranks": ranks}  # fmt: skip

    killed = [train(s, s / 1000, "killed") for s in (10, 20, 30, 40)]  # checkpoint at 20
    resumed = [train(s, s / 1000, "resumed") for s in (30, 40, 50)]
    log = tmp_path / "log.jsonl"
    lines = [{"kind": "start", "step": 0}, *killed, {"kind": "eval", "step": 20, "acc": 0.5}]
    lines += [{"kind": "start", "step": 20}, *resumed, {"kind": "eval", "step": 40, "acc": 0.7}]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = load_run(log)
    trains = [(r["step"], r["part"]) for r in records if r["kind"] == "train"]
    assert trains == [(10, "killed"), (20, "killed"), (30, "resumed"), (40, "resumed"),
                      (50, "resumed")]  # fmt: skip
    axes = {ax.get_ylabel(): ax for ax in figure({"run": records}).axes}
    assert set(axes) == {"training loss", "learning rate", "dev acc", "update time (ms)"}
    lr_line = axes["learning rate"].lines[0]
    assert list(lr_line.get_xdata()) == [10, 20, 30, 40, 50]
    assert list(lr_line.get_ydata()) == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05])
    assert list(axes["dev acc"].lines[0].get_ydata()) == [0.5, 0.7]
    assert [len(line.get_xdata()) for line in axes["update time (ms)"].lines[:2]] == [5, 5]


def test_plot_draws_a_log_of_one_step_as_points(tmp_path: Path) -> None:
    """A run with one log step: each panel shows its point (the per-rank update times were a
    line of one point, which draws nothing: an empty panel, an audit found)."""
    pytest.importorskip("matplotlib")
    ranks = [{"rank": 0, "update_ms": 5.0}, {"rank": 1, "update_ms": 7.0}]
    step = {"kind": "train", "step": 1, "loss": 0.5, "lr": 0.1, "ranks": ranks}
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(json.dumps(line) + "\n" for line in [{"kind": "start", "step": 0}, step])
    )
    for ax in figure({"run": load_run(log)}).axes:
        assert ax.lines and all(line.get_marker() == "o" for line in ax.lines), ax.get_ylabel()


def test_run_names(tmp_path: Path) -> None:
    paths = ["x/a/save/log.jsonl", "x/b/save/log.jsonl", "c/other.jsonl", "c/other.jsonl"]
    assert run_names([tmp_path / p for p in paths]) == ["a/save", "b/save", "other", "other#2"]
    assert run_names([tmp_path / "run1" / "log.jsonl"]) == ["run1"]


def test_main_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "env" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["plot"])  # RUN is required
    assert info.value.code == 2


@pytest.mark.usefixtures("no_dist_env")
def test_env_report_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    ok, lines = report(check=False)
    info = dict(lines)
    assert ok
    assert info["fastdist"].startswith(fastdist.__version__)
    assert info["torch"] == torch.__version__
    assert info["gloo available"] == str(dist.is_gloo_available())
    assert info["torchrun variables"].startswith("none")
    assert lines[-1][0] == "verdict" and "not launched by torchrun" in info["verdict"]
    # A torchrun world size without the rendezvous variables: DistTrainer would raise.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    ok, lines = report(check=False)
    assert not ok
    assert dict(lines)["verdict"].startswith("NO: WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT")


@pytest.mark.usefixtures("no_dist_env")
def test_check_process_group_leaves_no_group() -> None:
    formed, detail = check_process_group(timeout=20)
    assert formed, detail
    assert "all-reduce ok" in detail
    assert not dist.is_initialized()


@pytest.mark.slow
def test_env_command_without_torchrun() -> None:
    result = run_python("-m", ["fastdist", "env"], timeout=60)
    out = result.stdout
    for line in ("fastdist:", "torch:", "python:", "platform:", "CUDA available:"):
        assert line in out, result.describe()
    assert f" {fastdist.__version__} (" in out and f" {torch.__version__}\n" in out
    assert "NCCL available:" in out and "gloo available:        True" in out
    assert "torchrun variables:    none (not launched by torchrun)" in out
    assert "all-reduce ok" in out
    assert "\nverdict:               OK: a process group can be formed here" in out


@pytest.mark.slow
def test_env_command_with_torchrun_variables() -> None:
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(port)
    result = run_python("-m", ["fastdist", "env"], env=env, timeout=60)
    out = result.stdout
    assert f"RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in out
    verdict = out.split("verdict:")[1]
    assert "OK: under torchrun" in verdict and f"env:// at 127.0.0.1:{port}" in verdict
    assert "world size 1 (this process: rank 0, local rank 0)" in verdict


@pytest.mark.slow
def test_env_command_under_torchrun() -> None:
    result = run_torchrun("-m", 2, ["fastdist", "env", "--no-check"], timeout=90)
    for rank in range(2):
        line = f"world size 2 (this process: rank {rank}, local rank {rank})"
        assert line in result.stdout, result.describe()
    assert result.stdout.count("TORCHELASTIC_RUN_ID=") == 2


@pytest.mark.slow
def test_import_fastdist_does_not_import_matplotlib() -> None:
    code = "import sys, fastdist, fastdist.cli; assert 'matplotlib' not in sys.modules, 'heavy'"
    run_python("-c", [code], timeout=60)
