"""Bad input to ``DistTrainer`` under torchrun with 2 processes.

Argument errors must be raised alike on every rank, name the argument, and come before the
process group is created (so no rank waits in a collective). A loss that is not a scalar can
only be seen at the first micro-batch: every rank must raise, and the launch must end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from launch import run_torchrun

WORKER = Path(__file__).resolve().parent / "workers" / "validation_worker.py"

# case of validation_worker.BAD_INPUT -> (exception type, words its message must contain)
EXPECTED = {
    "batch_size_per_gpu": ("ValueError", ["batch_size_per_gpu", "0"]),
    "update_every": ("ValueError", ["update_every", "0"]),
    "n_epochs": ("ValueError", ["n_epochs", "0"]),
    "metric_key": ("ValueError", ["metric_key", "f1", "acc"]),
    "dev_data_without_metrics": ("ValueError", ["dev_data", "metrics"]),
    "foreign_optimizer": ("ValueError", ["optimizer", "not parameters of model"]),
    "empty_train_data": ("ValueError", ["train_data", "empty"]),
    "unknown_keyword": ("TypeError", ["batch_size"]),
    "too_few_samples_for_drop_last": ("ValueError", ["batch_size_per_gpu", "drop_last"]),
    "unknown_strategy": ("ValueError", ["strategy", "deepspeed", "'fsdp'"]),
    "flat_ddp_keyword": (
        "TypeError",
        ["bucket_cap_mb is an option of fastdist.strategies.DDP", "strategy=DDP(bucket_cap_mb=50)"],
    ),
    "flat_comm_hook": ("TypeError", ["ddp_comm_hook", "strategy=DDP(comm_hook='fp16')"]),
    "flat_fsdp_wrap": ("TypeError", ["fsdp_wrap", "fastdist.strategies.FSDP", "FSDP(wrap="]),
    "comm_hook_with_average_every": ("ValueError", ["comm_hook", "average_every", "choose one"]),
    "fsdp_wrap_absent": ("ValueError", ["wrap", "Conv2d"]),
    "cpu_offload_on_cpu": ("ValueError", ["cpu_offload", "CPU"]),
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bad_input(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every bad-input case in one launch; the JSON of each rank."""
    out = tmp_path_factory.mktemp("bad-input")
    result = run_torchrun(WORKER, 2, ["bad_input", str(out)], timeout=120, cwd=out)
    ranks = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results\n{result.describe()}"
        ranks.append(json.loads(path.read_text()))
    return ranks


def test_every_case_ran(bad_input: list[dict[str, Any]]) -> None:
    assert [set(rank) for rank in bad_input] == [set(EXPECTED)] * 2


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_input_fails_alike_before_the_process_group(
    case: str, bad_input: list[dict[str, Any]]
) -> None:
    errors = [rank[case] for rank in bad_input]
    exc_type, words = EXPECTED[case]
    for rank, error in enumerate(errors):
        assert error["type"] == exc_type, f"rank {rank}: {error}"
        for word in words:
            assert word in error["message"], f"rank {rank}: {word!r} not in {error['message']!r}"
        assert not error["group_after"], f"rank {rank}: process group created before the error"
    assert errors[0]["message"] == errors[1]["message"]


def test_non_scalar_loss_fails_on_every_rank(tmp_path: Path) -> None:
    """A per-sample loss raises ValueError at the first micro-batch on both ranks; no hang."""
    result = run_torchrun(
        WORKER, 2, ["non_scalar_loss", str(tmp_path)], timeout=90, cwd=tmp_path, check=False
    )
    assert result.returncode != 0, result.describe()
    errors = []
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} did not fail as expected\n{result.describe()}"
        errors.append(json.loads(path.read_text()))
    for rank, error in enumerate(errors):
        assert error["type"] == "ValueError", f"rank {rank}: {error}"
        assert "loss" in error["message"] and "scalar" in error["message"], error
        assert (error["global_step"], error["batch_idx"]) == (0, 0), error
    assert errors[0]["message"] == errors[1]["message"]
    assert errors[0]["message"] in result.stderr
