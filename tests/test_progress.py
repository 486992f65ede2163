"""What a run shows when stderr is not a terminal: plain lines, from rank 0 only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import run_torchrun

WORKER = Path(__file__).resolve().parent / "workers" / "multinode_worker.py"


@pytest.mark.slow
def test_non_tty_progress_is_plain_lines_from_rank_zero(tmp_path: Path) -> None:
    result = run_torchrun(WORKER, nproc=2, args=[str(tmp_path / "params.json")])
    assert "\r" not in result.output  # no carriage-return bar noise in logs
    lines = [line for line in result.stderr.splitlines() if " loss " in line]
    # 64 samples, batch 4 x 2 ranks, 2 epochs: 16 updates, logged every print_every=10.
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert "[rank 0]" in line
    match = re.search(r"epoch 2 step 10/16 loss \S+ lr 0\.05 (\d+) samples/s", line)
    assert match and int(match.group(1)) > 0, line
