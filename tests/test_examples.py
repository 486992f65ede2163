"""The README's example runs end to end on 2 real processes and on 1 plain process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import REPO_ROOT, run_python, run_torchrun

EXAMPLE = REPO_ROOT / "examples" / "train_digits.py"


def _check_run(output: str, workdir: Path) -> None:
    accuracy = re.search(r"best dev accuracy (\d\.\d+)", output)
    assert accuracy, output
    assert float(accuracy.group(1)) > 0.85  # 10 digit classes: chance is 0.1
    assert len(list((workdir / "save").glob("best_Classifier_acc_*.pt"))) == 1
    assert list((workdir / "logs").glob("log_*/metric.log")), "fitlog wrote no metrics"


@pytest.mark.slow
def test_example_two_processes(tmp_path: Path) -> None:
    result = run_torchrun(EXAMPLE, nproc=2, args=["--epochs", "3"], cwd=tmp_path, timeout=180)
    _check_run(result.output, tmp_path)
    assert "global batch 64 = 32 per process x 2" in result.output
    assert (tmp_path / "cache" / "digits.pt").exists()


@pytest.mark.slow
def test_example_one_plain_process(tmp_path: Path) -> None:
    result = run_python(EXAMPLE, args=["--epochs", "3"], cwd=tmp_path, timeout=180)
    _check_run(result.output, tmp_path)
    assert "[rank" not in result.output  # a world of one is not tagged
