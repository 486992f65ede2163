"""JSONLogCallback: the JSON Lines log of real trainings (torchrun with 2 processes, plain python)
and, in-process, appending, the default path and a failing run."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import make_trainer
from launch import Result, run_python, run_torchrun
from torch import nn

from fastdist.callbacks.json_log import JSONLogCallback

WORKER = Path(__file__).resolve().parent / "workers" / "json_log_worker.py"
N_TRAIN, BATCH, N_EPOCHS, PRINT_EVERY = 80, 8, 2, 2


def read_records(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    assert all(line.strip() for line in lines), "no blank lines"
    return [json.loads(line) for line in lines]


@dataclass
class Run:
    """One launch of the worker and what it left behind."""

    size: int
    validate_every: int
    result: Result
    records: list[dict[str, Any]]
    trainer_result: dict[str, Any]
    save_dir: Path


# name -> (use torchrun, world size, validate_every)
WORLDS = {"torchrun-2": (True, 2, -1), "python-1": (False, 1, 3)}


@pytest.fixture(scope="module", params=list(WORLDS))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    torchrun, size, validate_every = WORLDS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    args = [str(out), "--print-every", str(PRINT_EVERY), "--validate-every", str(validate_every)]
    args += ["--n-train", str(N_TRAIN), "--n-epochs", str(N_EPOCHS)]
    result = run_torchrun(WORKER, size, args) if torchrun else run_python(WORKER, args)
    log = out / "save" / "log.jsonl"  # the default: <save_path>/log.jsonl
    assert log.is_file(), result.describe()
    trainer_result = json.loads((out / "result.json").read_text())
    return Run(size, validate_every, result, read_records(log), trainer_result, out / "save")


def expected_steps(run: Run) -> tuple[list[int], list[int], int]:
    """(steps with a "train" record, steps with an "eval" record, updates per epoch)."""
    per_epoch = math.ceil(N_TRAIN / run.size / BATCH)
    total = per_epoch * N_EPOCHS
    ve = run.validate_every
    train = [s for s in range(1, total + 1) if s % PRINT_EVERY == 0]
    evals = [s for s in range(1, total + 1) if (s % ve == 0 if ve > 0 else s % per_epoch == 0)]
    return train, evals, per_epoch


@pytest.mark.slow
def test_one_start_and_one_end_record(run: Run) -> None:
    kinds = [r["kind"] for r in run.records]
    assert kinds[0] == "start" and kinds[-1] == "end", kinds
    assert kinds.count("start") == 1 and kinds.count("end") == 1, "only rank 0 writes"
    assert set(kinds) == {"start", "train", "eval", "end"}
    assert [p.name for p in run.save_dir.glob("*.jsonl")] == ["log.jsonl"]
    start = run.records[0]
    assert start["world_size"] == run.size
    assert start["global_batch"] == BATCH * run.size
    assert start["config"]["print_every"] == PRINT_EVERY
    assert start["config"]["batch_size_per_gpu"] == BATCH
    assert start["config"]["save_path"] == str(run.save_dir)
    datetime.strptime(start["start_time"], "%Y-%m-%dT%H:%M:%S%z")  # ISO 8601
    end = run.records[-1]
    for key in ("best_eval", "best_epoch", "best_step", "steps"):
        assert end[key] == run.trainer_result[key], key
    assert end["seconds"] > 0
    times = [r["time"] for r in run.records]
    assert times == sorted(times)


@pytest.mark.slow
def test_a_train_record_per_logged_loss(run: Run) -> None:
    train_steps, _, per_epoch = expected_steps(run)
    train = [r for r in run.records if r["kind"] == "train"]
    steps = [r["step"] for r in train]
    assert steps == train_steps
    assert steps == sorted(set(steps)), "strictly increasing, no duplicates"
    # The values are the ones the trainer logged at that step, not a stale earlier loss.
    pattern = r"epoch (\d+) step (\d+)/\d+ loss (\S+)"
    logged = {int(s): (int(e), float(v)) for e, s, v in re.findall(pattern, run.result.stderr)}
    assert sorted(logged) == steps, run.result.describe()
    for record in train:
        epoch, loss = logged[record["step"]]
        assert record["epoch"] == epoch == math.ceil(record["step"] / per_epoch)
        assert round(record["loss"], 4) == pytest.approx(loss, abs=1e-4)
        assert record["lr"] == pytest.approx(0.1)
        assert record["samples_per_s"] > 0
        assert record["memory_mb"] > 0
        keys = {"kind", "step", "epoch", "loss", "lr", "time", "samples_per_s", "memory_mb"}
        assert set(record) == keys | {"ranks"}
        assert [r["rank"] for r in record["ranks"]] == list(range(run.size))


@pytest.mark.slow
def test_an_eval_record_per_evaluation(run: Run) -> None:
    _, eval_steps, per_epoch = expected_steps(run)
    evals = [r for r in run.records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == eval_steps
    for record in evals:
        assert 0.0 <= record["acc"] <= 1.0
        assert record["epoch"] == math.ceil(record["step"] / per_epoch)
    best = max(r["acc"] for r in evals)
    assert run.trainer_result["best_eval"] == {"acc": best}


# In-process: a one-process world without a process group.


@pytest.mark.usefixtures("no_dist_env")
def test_runs_are_appended_and_the_file_closed(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "run.jsonl"  # the directory is created
    callback = JSONLogCallback(path)
    for _ in range(2):
        make_trainer(callback).train()
        assert callback.logger.file is None, "closed at train end"
    kinds = [r["kind"] for r in read_records(path)]
    one_run = ["start", "train", "train", "train", "eval", "end"]  # steps 2, 4, 6; eval at 6
    assert kinds == one_run + one_run


@pytest.mark.usefixtures("no_dist_env")
def test_default_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    callback = JSONLogCallback()
    make_trainer(callback).train()  # no save_path: ./log.jsonl
    assert read_records(tmp_path / "log.jsonl")[0]["kind"] == "start"
    callback = JSONLogCallback()
    make_trainer(callback, save_path=str(tmp_path / "save")).train()
    assert read_records(tmp_path / "save" / "log.jsonl")[-1]["kind"] == "end"


@pytest.mark.usefixtures("no_dist_env")
def test_a_failing_run_is_recorded_and_closed(tmp_path: Path) -> None:
    calls = []

    def loss(output: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("deliberate failure")
        return nn.functional.cross_entropy(output["pred"], batch[-1])

    callback = JSONLogCallback(tmp_path / "log.jsonl")
    with pytest.raises(RuntimeError, match="deliberate failure"):
        make_trainer(callback, loss=loss).train()
    assert callback.logger.file is None
    records = read_records(tmp_path / "log.jsonl")
    # Log step 4's loss is read after update 5, which failed: it is not recorded.
    assert [r["kind"] for r in records] == ["start", "train", "exception"]
    assert records[-1]["error"] == "RuntimeError: deliberate failure"
    assert records[-1]["step"] == 4
