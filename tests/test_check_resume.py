"""``python -m fastdist check-resume``: a script run through, and killed halfway then resumed.

The script (tests/workers/resume_script.py) runs as a user's would, in one process: the tool
runs it three times and compares the final checkpoints' models.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import TESTS_DIR, run_python

from fastdist.cli import main as cli_main

SCRIPT = TESTS_DIR / "workers" / "resume_script.py"


def _check_resume(tmp_path: Path, *script_args: str) -> tuple[int, str]:
    tool = ["fastdist", "check-resume", str(SCRIPT), "--updates", "6", "--dir", "runs"]
    args = [*tool, "--", *script_args] if script_args else tool
    result = run_python("-m", args, cwd=tmp_path, timeout=240, check=False)
    return result.returncode, result.output


@pytest.mark.slow
def test_a_resumable_script_passes(tmp_path: Path) -> None:
    code, output = _check_resume(tmp_path)
    assert code == 0, output
    message = "killed at update 3 and resumed, the model at update 6 equals an uninterrupted"
    assert f"check-resume passed: {message} run's, bit for bit" in output
    assert list((tmp_path / "runs").iterdir()) == []  # emptied; the user's --dir stays
    assert not (tmp_path / "save").exists()  # the script's own save_path is not used


@pytest.mark.slow
def test_a_random_number_outside_the_trainer_fails_naming_the_parameter(tmp_path: Path) -> None:
    code, output = _check_resume(tmp_path, "--unresumable")
    assert code == 1, output
    assert "check-resume FAILED: the resumed run differs at update 6 in:" in output
    diff = re.search(r"^  head\.bias: max abs diff ([0-9.e-]+)$", output, re.MULTILINE)
    assert diff is not None and float(diff.group(1)) > 0, output
    runs = tmp_path / "runs"
    assert (runs / "through" / "checkpoints" / "step-00000006.pt").exists()
    # the killed run left its checkpoint at update 3, from which the third run resumed
    assert "resumed from" in (runs / "resumed.log").read_text()
    assert "step-00000003.pt: 24 samples into epoch 1" in (runs / "resumed.log").read_text()


@pytest.mark.slow
def test_a_script_that_trains_fewer_updates_fails_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 epochs of 2 updates: the straight run ends at update 4 of the 6 asked for; the check
    says so after it, without the other two runs. (The tool runs in this process.)"""
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR.parent))  # the script imports this tree
    runs = tmp_path / "runs"
    tool = ["check-resume", str(SCRIPT), "--updates", "6", "--dir", str(runs), "--", "--small"]
    assert cli_main(tool) == 2
    error = capsys.readouterr().err
    assert "the run trained 4 updates, fewer than the 6 it had to" in error
    assert "pass --updates 4, or train longer (more data or epochs)" in error
    assert not (runs / "killed.log").exists()


def test_a_script_that_never_trains_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "no_trainer.py"
    script.write_text('print("I train nothing")\n')
    assert cli_main(["check-resume", str(script), "--dir", str(tmp_path / "runs")]) == 2
    error = capsys.readouterr().err
    assert "the script exited without calling DistTrainer.train()" in error, error


def test_bad_arguments_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check-resume", str(SCRIPT), "--updates", "5"]) == 2
    assert "--updates 5: pass an even number >= 2" in capsys.readouterr().err
    assert cli_main(["check-resume", "missing.py"]) == 2
    assert "SCRIPT 'missing.py' is not a file" in capsys.readouterr().err
    for timeout in ("0", "-5"):
        assert cli_main(["check-resume", str(SCRIPT), "--timeout", timeout]) == 2
        error = capsys.readouterr().err
        assert f"--timeout {timeout}: pass the seconds each run may take, above 0" in error
    with pytest.raises(SystemExit):  # argparse's usage error
        cli_main(["env", "--", "x"])
    assert "only check-resume takes arguments after --" in capsys.readouterr().err
    assert cli_main(["check-resume", str(SCRIPT), "--dir", str(SCRIPT)]) == 2
    assert f"--dir {SCRIPT} is a file: pass a new or empty directory" in capsys.readouterr().err
    for timeout in ("0", "nan"):
        with pytest.raises(SystemExit):
            cli_main(["env", "--timeout", timeout])
        assert f"must be seconds above 0, at most 86400, got {timeout}" in capsys.readouterr().err
