"""Loggers as backends: real trainings (torchrun, 2 processes) written to MLflow (an SQLite
store read back with MlflowClient), W&B (offline files parsed back), TensorBoard (its event
reader) and fitlog, each compared with ``log.jsonl``; a killed and resumed run, and a rollback;
failing backends (a full disk, a missing package, an unreachable server, a state that cannot be
saved or restored) that warn once while training finishes; a save_path held by another run;
bad backend arguments refused when built."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from inprocess import make_trainer
from launch import Result, free_port, run_torchrun
from test_disk_full import tmpfs  # noqa: F401  (a fixture)

from fastdist.callbacks import Callback, JSONLogCallback, RunLogCallback
from fastdist.loggers import (
    JsonLogger,
    Logger,
    MLflowLogger,
    RunContext,
    RunLog,
    TensorBoardLogger,
    WandbLogger,
)
from fastdist.loggers.backend import scalars
from fastdist.loggers.mlflow_runs import CONTINUES, FROM_STEP, SUPERSEDED_BY

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

WORKER = Path(__file__).resolve().parent / "workers" / "loggers_worker.py"
ENV = {"WANDB_SILENT": "true", "WANDB_MODE": None, "MLFLOW_TRACKING_URI": None}
TRAIN_STEPS, EVAL_STEPS = [2, 4, 6, 8, 10, 12, 14], [5, 10, 15]  # 5 updates per epoch, 3 epochs


@dataclass
class Run:
    result: Result
    save: Path
    records: list[dict[str, Any]]
    first: Result | None = None  # the killed launch a resume followed

    def expected(self, last: bool = False) -> dict[str, dict[int, float]]:
        """Every scalar of ``log.jsonl``: name -> {step: value}, the first value of a step
        written twice (by a killed run and its resume), or with ``last`` the last one."""
        found: dict[str, dict[int, float]] = {}
        for record in self.records:
            if record["kind"] in ("train", "eval"):
                for name, value in scalars(record).items():
                    steps = found.setdefault(name, {})
                    if last or record["step"] not in steps:
                        steps[record["step"]] = value
        return found


def launch(out: Path, *args: str, check: bool = True) -> Run:
    result = run_torchrun(WORKER, 2, [str(out), *args], timeout=400, env=ENV, check=check)
    return read(out / "save", result)


def read(save: Path, result: Result) -> Run:
    log = save / "log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return Run(result, save, records)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """With failing backends, an unreachable MLflow server, and then a run into a save_path
    this process holds locked."""
    out = tmp_path_factory.mktemp("full")
    (out / "locked").mkdir()
    with open(out / "locked" / ".fastdist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write(f"pid {os.getpid()} on host test\n")
        lock.flush()
        unreachable = ["--unreachable", str(free_port()), "--locked", str(out / "locked")]
        return launch(out, "--failing", *unreachable)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Killed and resumed, with backends whose state cannot be saved or restored; then a
    rollback in another save_path (``rollback``)."""
    out = tmp_path_factory.mktemp("resumed")
    killed = launch(out, "--kill-at", "13", "--bad-state", check=False)
    assert killed.result.returncode != 0, killed.result.describe()
    assert not (out / "result.json").exists()
    run = launch(out, "--bad-state", "--rollback")
    run.first = killed.result
    return run


def mlflow_history(save: Path) -> tuple[list[Any], dict[str, list[tuple[int, float]]]]:
    """The runs of the worker's experiment, and the first one's metrics: name -> [(step, v)]."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{save / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("loggers-test")
    runs = client.search_runs([experiment.experiment_id])
    run_id = runs[0].info.run_id
    history = {
        name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)]
        for name in runs[0].data.metrics
    }
    return runs, history


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B ``.wandb`` file (a LevelDB-style log of 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert raw[:4] == b":W&B", raw[:7]
    while pos + 7 <= len(raw):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the padding at a block's end
            pos += left
            continue
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_file: Path) -> dict[str, list[tuple[int, float]]]:
    history: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                name = item.key or "/".join(item.nested_key)
                if not name.startswith("_"):
                    history.setdefault(name, []).append((step, json.loads(item.value_json)))
    return history


def tensorboard_history(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def assert_same(history: dict[str, list[tuple[int, float]]], run: Run, last: bool = False) -> None:
    """``history`` holds exactly ``log.jsonl``'s names, steps and values, no step twice."""
    expected = run.expected(last)
    assert set(history) == set(expected)
    for name, points in history.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), (name, steps)
        assert dict(points) == pytest.approx(expected[name], rel=1e-6), name


@pytest.mark.slow
def test_mlflow_holds_the_log_jsonl_metrics_and_options(full: Run) -> None:
    runs, history = mlflow_history(full.save)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].info.run_name == "tiny"
    assert_same(history, full)
    assert [step for step, _ in history["loss"]] == TRAIN_STEPS
    assert [step for step, _ in history["dev/acc"]] == EVAL_STEPS
    assert {"time/update_ms/rank0", "time/update_ms/rank1", "lr", "memory_mb"} <= set(history)
    params = runs[0].data.params
    assert params["world_size"] == "2" and params["batch_size_per_gpu"] == "8"


@pytest.mark.slow
def test_wandb_offline_files_hold_the_same(full: Run) -> None:
    (run_file,) = full.save.glob("wandb/offline-run-*/run-*.wandb")
    assert_same(wandb_history(run_file), full)
    configs = [r.run.config for r in wandb_records(run_file) if r.HasField("run")]
    configs += [r.config for r in wandb_records(run_file) if r.HasField("config")]
    values = {i.key: json.loads(i.value_json) for c in configs for i in c.update}
    assert values["world_size"] == 2 and values["print_every"] == 2


@pytest.mark.slow
def test_tensorboard_and_fitlog_hold_the_same(full: Run) -> None:
    assert_same(tensorboard_history(full.save / "tensorboard"), full)
    (loss_log,) = full.save.glob("fitlog/log_*/loss.log")
    steps = [
        json.loads(line.split("\t", 1)[1])["step"]
        for line in loss_log.read_text().split("\n")
        if line
    ]
    assert steps == TRAIN_STEPS


@pytest.mark.slow
def test_a_failing_backend_warns_once_and_training_finishes(full: Run) -> None:
    output = full.result.output
    assert output.count("logger DiskFull failed") == 1, full.result.describe()
    assert "No space left on device" in output
    assert [r["kind"] for r in full.records][-1] == "end"
    assert json.loads((full.save.parent / "result.json").read_text())["steps"] == 15


@pytest.mark.slow
def test_a_killed_and_resumed_run_continues_the_same_runs(resumed: Run) -> None:
    starts = [r["step"] for r in resumed.records if r["kind"] == "start"]
    assert starts == [0, 10], "killed after step 13, resumed from the checkpoint of step 10"
    runs, history = mlflow_history(resumed.save)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", "the same MLflow run"
    assert_same(history, resumed)  # step 12, logged before the kill, is not written again
    assert [step for step, _ in history["loss"]] == TRAIN_STEPS
    # TensorBoard drops what the killed run wrote after step 10: the resume's values stay.
    assert_same(tensorboard_history(resumed.save / "tensorboard"), resumed, last=True)
    run_files = sorted(resumed.save.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 2 and run_files[0].name == run_files[1].name, "the same W&B run"
    assert min(step for s in wandb_history(run_files[1]).values() for step, _ in s) > 10


@pytest.mark.slow
def test_an_unreachable_mlflow_server_costs_seconds_and_one_warning(full: Run) -> None:
    failed = [line for line in full.result.output.splitlines() if "logger MLflowLogger" in line]
    assert len(failed) == 1 and "http://127.0.0.1:" in failed[0], full.result.describe()
    assert "unreachable" in failed[0]
    result = json.loads((full.save.parent / "result.json").read_text())
    assert result["steps"] == 15 and result["seconds"] < 60, result


@pytest.mark.slow
def test_a_second_run_in_a_held_save_path_or_checkpoint_dir_fails_on_every_rank(full: Run) -> None:
    errors = [(full.save.parent / f"locked-{rank}.txt").read_text() for rank in (0, 1)]
    assert errors[0] == errors[1], errors
    locked = str(full.save.parent / "locked")
    in_save_path, in_checkpoint_dir = errors[0].splitlines()
    assert f"save_path={locked!r} is in use by another run (pid {os.getpid()}" in in_save_path
    assert in_save_path.startswith("OSError") and "pass another save_path" in in_save_path
    # a checkpoint_dir shared by two runs (each its own save_path) is refused alike
    holder = f"(pid {os.getpid()} on host test)"
    expected = f"checkpoint_dir={locked!r} is in use by another run {holder}"
    assert expected in in_checkpoint_dir and "pass another checkpoint_dir" in in_checkpoint_dir
    assert not (full.save.parent / "own" / "log.jsonl").exists()  # refused before training


@pytest.mark.slow
def test_a_backend_whose_state_fails_warns_once_and_the_resume_goes_on(resumed: Run) -> None:
    assert resumed.first is not None
    for output in (resumed.first.output, resumed.result.output):
        assert output.count("logger BadSave failed (state_dict") == 1, output
    loads = [line for line in resumed.result.output.splitlines() if "logger BadLoad" in line]
    assert len(loads) == 1 and "load_state_dict" in loads[0], resumed.result.output
    assert "starts afresh" in loads[0]
    assert [r["kind"] for r in resumed.records][-1] == "end"


@pytest.mark.slow
def test_a_rollback_continues_in_a_new_run_that_supersedes_the_old(resumed: Run) -> None:
    """Trained to step 15, rolled back to step 10 on other data: the new MLflow run holds the
    old one's steps up to 10 and the new steps after; the old one keeps the discarded ones."""
    rolled = read(resumed.save.parent / "rollback", resumed.result)
    assert [r["step"] for r in rolled.records if r["kind"] == "start"] == [0, 10]
    assert rolled.expected()["loss"] != rolled.expected(last=True)["loss"], "other values"
    client, runs = mlflow_runs(resumed.save / "mlflow.db", "rollback")
    assert len(runs) == 2, [r.info.run_id for r in runs]
    (old,) = [r for r in runs if SUPERSEDED_BY in r.data.tags]
    (new,) = [r for r in runs if r is not old]
    assert old.data.tags[SUPERSEDED_BY] == new.info.run_id
    assert new.data.tags[CONTINUES] == old.info.run_id and new.data.tags[FROM_STEP] == "10"

    def history(run: Any) -> dict[str, list[tuple[int, float]]]:
        get = client.get_metric_history
        return {k: [(m.step, m.value) for m in get(run.info.run_id, k)] for k in run.data.metrics}

    assert_same(history(new), rolled, last=True)  # steps <= 10 copied, the new ones after
    assert_same(history(old), rolled)  # the first training's, discarded branch included
    # Both runs may start in the same second: their directories' names then sort by run id.
    files = list(rolled.save.glob("wandb/offline-run-*/run-*.wandb"))
    runs_by_id: dict[str, Any] = {}
    for path in files:
        (record,) = [r.run for r in wandb_records(path) if r.HasField("run")]
        runs_by_id[path.name[4:-6]] = record
    assert len(runs_by_id) == len(files) == 2, files  # a new W&B run
    (forked_id,) = [i for i, r in runs_by_id.items() if r.branch_point.run]
    (first_id,) = set(runs_by_id) - {forked_id}
    point = runs_by_id[forked_id].branch_point
    assert point.run == first_id and point.value == 10


# In-process: a one-process world without a process group.


@pytest.mark.usefixtures("no_dist_env")
def test_a_missing_package_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # import fails
    callback = RunLogCallback([MLflowLogger(), JsonLogger(tmp_path / "log.jsonl")])
    result = make_trainer(callback, n_epochs=2).train()
    assert result["steps"] == 12
    failed = [line for line in log_lines if "logger MLflowLogger failed" in line]
    assert len(failed) == 1 and failed[0].startswith("WARNING"), log_lines
    assert 'pip install "fastdist[mlflow]"' in failed[0]
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert kinds[-1] == "end", "the other backend wrote on"


@pytest.mark.usefixtures("no_dist_env")
def test_a_full_disk_warns_once(tmp_path: Path, log_lines: list[str]) -> None:
    callback = RunLogCallback([JsonLogger("/dev/full")])  # every write: ENOSPC
    assert make_trainer(callback, n_epochs=2).train()["steps"] == 12
    failed = [line for line in log_lines if "logger JsonLogger failed" in line]
    assert len(failed) == 1 and "No space left on device" in failed[0], log_lines


@pytest.mark.usefixtures("no_dist_env")
@pytest.mark.parametrize(
    ("loggers", "message"),
    [
        (
            JsonLogger(),
            r"loggers must be a list of .*, got a single JsonLogger: .*\[JsonLogger\(\)\]",
        ),
        (
            ["log.jsonl"],
            r"loggers must hold fastdist.loggers backends; loggers\[0\] is 'log.jsonl'",
        ),
        (JsonLogger, r"loggers must be a list"),
    ],
)
def test_bad_loggers_are_named(loggers: Any, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        make_trainer(RunLogCallback([]), loggers=loggers)


@pytest.fixture(scope="module")
def store(full: Run) -> Path:
    """An MLflow SQLite store: the launched run's (a new one's tables take seconds to make);
    the tests below write to experiments of their own, or a copy."""
    return full.save / "mlflow.db"


def mlflow_runs(path: Path, experiment: str) -> tuple[Any, list[Any]]:
    """A client of the store at ``path`` and the runs of ``experiment`` there."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{path}")
    found = client.get_experiment_by_name(experiment)
    return client, client.search_runs([found.experiment_id]) if found else []


@pytest.mark.slow
@pytest.mark.usefixtures("no_dist_env")
def test_a_logger_reused_by_another_trainer_starts_a_new_run(tmp_path: Path, store: Path) -> None:
    """Only a checkpoint's run id is continued: a second trainer's fresh train() with the same
    backend objects starts new runs."""
    mlflow = MLflowLogger(tracking_uri=f"sqlite:///{store}", experiment="reused")
    wandb = WandbLogger(mode="offline", dir=tmp_path)
    ids = []
    for _ in range(2):
        make_trainer(RunLogCallback([mlflow, wandb]), n_epochs=1).train()
        ids.append((mlflow.run_id, wandb.run_id))
    _client, runs = mlflow_runs(store, "reused")
    assert len(runs) == 2 and ids[0][0] != ids[1][0] and ids[0][1] != ids[1][1], ids


@pytest.mark.slow
@pytest.mark.usefixtures("no_dist_env")
def test_a_resume_without_the_old_store_starts_a_tagged_run(
    tmp_path: Path, store: Path, log_lines: list[str]
) -> None:
    """Resumed into another save_path whose store lacks the checkpoint's run."""
    other = tmp_path / "other.db"
    shutil.copy(store, other)
    first = MLflowLogger(tracking_uri=f"sqlite:///{store}", experiment="moved")
    save = str(tmp_path / "a")
    make_trainer(RunLogCallback([]), loggers=[first], save_path=save, n_epochs=1).train()
    trainer = make_trainer(
        RunLogCallback([]),
        loggers=[MLflowLogger(tracking_uri=f"sqlite:///{other}", experiment="moved")],
        save_path=str(tmp_path / "b"),
        n_epochs=2,
    )
    assert trainer.train(resume=f"{save}/checkpoints/step-00000006.pt")["steps"] == 12
    assert not [line for line in log_lines if "logger MLflowLogger failed" in line], log_lines
    assert any("is not in the tracking store" in line for line in log_lines), log_lines
    client, (run,) = mlflow_runs(other, "moved")
    assert run.data.tags[CONTINUES] == first.run_id and run.data.tags[FROM_STEP] == "6"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [8, 10, 12]


@pytest.mark.slow
def test_a_plain_resume_of_a_superseded_run_continues_its_successor(store: Path) -> None:
    """Rolled back to step 10 and killed before the next checkpoint: the checkpoint of step 10
    names the old run, and a plain resume from it continues the new one (the old one holds the
    discarded steps); a rollback to step 5 branches off the old run again, superseding both."""
    from mlflow.entities import Metric

    client, _ = mlflow_runs(store, "chain")
    experiment = client.create_experiment("chain")
    old = client.create_run(experiment).info.run_id
    client.log_batch(old, metrics=[Metric("loss", 1.0, 0, step) for step in (5, 10, 15)])
    new = client.create_run(experiment, tags={CONTINUES: old, FROM_STEP: "10"}).info.run_id
    client.set_tag(old, SUPERSEDED_BY, new)
    logger = MLflowLogger(tracking_uri=f"sqlite:///{store}", experiment="chain")
    for step, rollback in ((10, False), (5, True)):
        logger.load_state_dict({"run_id": old})
        logger.open(RunContext(None, step, rollback))
        logger.close(failed=False)
        assert (logger.run_id == new) is (step == 10), (step, logger.run_id, old, new)
    assert client.get_run(logger.run_id).data.tags[FROM_STEP] == "5"
    for run_id in (old, new):  # both hold steps after 5 of a discarded branch
        assert client.get_run(run_id).data.tags[SUPERSEDED_BY] == logger.run_id, run_id


@pytest.mark.usefixtures("no_dist_env")
def test_the_run_log_is_written_beside_a_json_logger_of_another_path(tmp_path: Path) -> None:
    """save_path/log.jsonl is the run's own record: a JsonLogger elsewhere does not replace
    it, and one given that path writes it once."""
    save, extra = tmp_path / "save", tmp_path / "elsewhere" / "extra.jsonl"
    make_trainer(RunLogCallback([]), loggers=[JsonLogger(extra)], save_path=str(save)).train()
    records = [json.loads(line) for line in (save / "log.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records].count("train") == 3  # 6 updates, print_every=2
    assert extra.read_text() != "" and len(extra.read_text().splitlines()) == len(records)
    other = tmp_path / "other"
    trainer = make_trainer(
        RunLogCallback([JsonLogger(other / "log.jsonl")]), n_epochs=1, save_path=str(other)
    )
    trainer.train()
    kinds = [json.loads(line)["kind"] for line in (other / "log.jsonl").read_text().splitlines()]
    assert kinds.count("start") == 1 and kinds.count("end") == 1, kinds
    linked = tmp_path / "linked"  # a hard link to save_path/log.jsonl is that file
    linked.mkdir()
    (linked / "log.jsonl").touch()
    os.link(linked / "log.jsonl", tmp_path / "link.jsonl")
    logger = JsonLogger(tmp_path / "link.jsonl")
    make_trainer(RunLogCallback([]), loggers=[logger], n_epochs=1, save_path=str(linked)).train()
    kinds = [json.loads(line)["kind"] for line in (linked / "log.jsonl").read_text().splitlines()]
    assert kinds.count("start") == 1, kinds


@pytest.mark.usefixtures("no_dist_env")
@pytest.mark.parametrize(
    "loggers",
    [
        lambda save: [JsonLogger(), JsonLogger()],
        lambda save: [JsonLogger(), JsonLogger(save / "log.jsonl")],
        lambda save: [TensorBoardLogger(), TensorBoardLogger(save / "tensorboard")],
        lambda save: [JsonLogger(), JsonLogger(save.parent / "link" / "log.jsonl")],
        lambda save: [WandbLogger(mode="offline"), WandbLogger(mode="offline", dir=save)],
    ],
)
def test_two_backends_writing_one_file_are_refused(tmp_path: Path, loggers: Any) -> None:
    save = tmp_path / "save"
    (tmp_path / "link").symlink_to(save, target_is_directory=True)  # dangling until made
    with pytest.raises(
        ValueError,
        match=r"^(a (\w+) in loggers \(.*\) and a \2 in loggers \(.*\) both write|"
        r"loggers holds two)",
    ):
        make_trainer(RunLogCallback([]), loggers=loggers(save), save_path=str(save))
    assert not save.exists()


@pytest.mark.usefixtures("no_dist_env")
def test_a_hard_link_or_a_callbacks_file_is_the_same_file(tmp_path: Path) -> None:
    """Two paths of one file (a hard link), and a logger a callback holds: refused, naming
    where each was given."""
    save = tmp_path / "save"
    save.mkdir()
    (save / "a.jsonl").touch()
    os.link(save / "a.jsonl", save / "b.jsonl")
    with pytest.raises(ValueError, match=r"^a JsonLogger in loggers \('.*a.jsonl'\) and a JsonL"):
        make_trainer(
            RunLogCallback([]),
            loggers=[JsonLogger(save / "a.jsonl"), JsonLogger(save / "b.jsonl")],
            save_path=str(save),
        )
    with pytest.raises(
        ValueError,
        match=r"^a JsonLogger in loggers \(.*\) and the JsonLogger of a JSONLogCallback in "
        r"callbacks_master \('.*/save/log.jsonl'\) both write",
    ):
        make_trainer(JSONLogCallback(), loggers=[JsonLogger()], save_path=str(save))


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: WandbLogger(mode="ofline"), ValueError, r"WandbLogger\(mode\) must be one of"),
        (lambda: MLflowLogger(experiment=""), ValueError, r"experiment\) must be a name \(a n"),
        (lambda: MLflowLogger(experiment=None), TypeError, r"experiment\) must be a name \(a n"),
        (lambda: MLflowLogger(tracking_uri=5), TypeError, r"MLflowLogger\(tracking_uri\) must"),
        (lambda: JsonLogger(path="."), ValueError, r"JsonLogger\(path\)='.' is a directory"),
        (lambda: JsonLogger(path=3), TypeError, r"JsonLogger\(path\) must be a file path"),
        (lambda: TensorBoardLogger(flush_secs=0), ValueError, r"flush_secs\) must be a number"),
    ],
)
def test_bad_backend_arguments_raise_when_built(make: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make()


class FillDisk(Callback):
    """Fill the disk holding ``path`` after update 2."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == 2:
            with open(self.path, "wb") as filler, contextlib.suppress(OSError):
                while True:
                    filler.write(b"x" * 65536)


@pytest.mark.usefixtures("no_dist_env")
def test_wandb_on_a_full_disk_warns_naming_the_directory(
    request: pytest.FixtureRequest, log_lines: list[str]
) -> None:
    mount: Path = request.getfixturevalue("tmpfs")  # 1.5 MiB (tests/test_disk_full.py)
    logger = WandbLogger(mode="offline", dir=mount)
    callback = RunLogCallback([logger])
    make_trainer(callback, callbacks_all=[FillDisk(mount / "filler")], n_epochs=2).train()
    lost = [line for line in log_lines if "may have lost data" in line]
    assert len(lost) == 1 and str(mount / "wandb") in lost[0], log_lines


def test_mlflow_skips_per_metric_and_renames_the_names_it_refuses(
    store: Path, log_lines: list[str]
) -> None:
    """A resume skips a metric only at steps the run holds *that metric* at (pre-empted on an
    epoch's last update: the evaluation at that step comes after the resume); names MLflow
    refuses are renamed, uniquely, with one warning, and the run still ends FINISHED."""
    logger = MLflowLogger(tracking_uri=f"sqlite:///{store}", experiment="per-key")
    logger.open(RunContext(None, 0))
    logger.log_scalars({"loss": 1.0, "f1@5": 0.5, "f1_5": 0.2, "p(r)": 0.1}, 6)
    logger.close(failed=False)
    logger.load_state_dict(logger.state_dict())
    logger.open(RunContext(None, 6))
    logger.log_scalars({"loss": 2.0}, 6)  # held: skipped
    logger.log_scalars({"dev/acc": 0.9, "f1@5": 0.7}, 6)  # the evaluation after the resume
    logger.log_scalars({"loss": 3.0}, 8)
    logger.close(failed=False)
    client, (run,) = mlflow_runs(store, "per-key")
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
    assert run.info.status == "FINISHED", run.info
    assert history == {
        "loss": [(6, 1.0), (8, 3.0)],
        "dev/acc": [(6, 0.9)],
        "f1_5": [(6, 0.2)],
        "f1_5_2": [(6, 0.5)],
        "p_r_": [(6, 0.1)],
    }, history
    renamed = [line for line in log_lines if "renamed" in line]
    assert len(renamed) == 1 and "f1@5" in renamed[0] and "p(r)" in renamed[0], log_lines


class Held(Logger):
    """A backend whose state is its tag; it records the state it was given."""

    def __init__(self, tag: str) -> None:
        self.tag, self.loaded = tag, ""

    def state_dict(self) -> dict[str, str]:
        return {"tag": self.tag}

    def load_state_dict(self, state: dict[str, str]) -> None:
        self.loaded = state["tag"]


def test_backend_states_follow_class_and_occurrence_not_position(log_lines: list[str]) -> None:
    """A backend added in front between a kill and the rerun: each backend still gets its own
    state (also from a checkpoint keyed by position); state left over is named in a warning."""
    state = RunLog([Held("a"), Held("b")]).state_dict()
    assert state == {"Held": {"tag": "a"}, "Held#2": {"tag": "b"}}, state
    positional = {"0:Held": {"tag": "a"}, "1:Held": {"tag": "b"}}
    for saved in (state, positional):
        backends = [JsonLogger(), Held("x"), Held("y")]
        RunLog(backends).load_state_dict(saved)
        assert [b.loaded for b in backends[1:]] == ["a", "b"], saved  # type: ignore[attr-defined]
    assert not [line for line in log_lines if "no longer given" in line], log_lines
    RunLog([Held("x")]).load_state_dict(state)
    left = [line for line in log_lines if "no longer given" in line]
    assert len(left) == 1 and "Held#2" in left[0], log_lines


def test_a_backend_state_a_checkpoint_could_not_load_is_dropped_with_a_warning(
    log_lines: list[str],
) -> None:
    """A Path in a backend's state would make every resume skip the checkpoint: the backend's
    state is left out, with one warning naming it; the others' is kept."""
    odd = Held("a")
    odd.state_dict = lambda: {"dir": Path("/tmp")}  # type: ignore[method-assign]
    state = RunLog([odd, Held("b")]).state_dict()
    assert state == {"Held#2": {"tag": "b"}}, state
    warned = [line for line in log_lines if "logger Held failed" in line]
    assert len(warned) == 1 and "state_dict()['dir']: pathlib.PosixPath" in warned[0], log_lines


class Breaks(Logger):
    """A backend whose writes raise; it records its closes."""

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        raise OSError(errno.EIO, "gone")

    def close(self, failed: bool) -> None:
        self.closed.append(failed)
        raise RuntimeError("close broke too")


def test_a_dropped_backend_is_still_closed_as_failed(log_lines: list[str]) -> None:
    """(an MLflow run is not left RUNNING); its close raising too is not reported again."""
    backend = Breaks()
    log = RunLog([backend])
    log.active = [backend]
    log._guarded(backend, "train", backend.write, {"kind": "train", "step": 2, "loss": 1.0})
    log.close(failed=False)
    assert backend.closed == [True] and not log.active, backend.closed
    assert len([line for line in log_lines if "logger Breaks failed" in line]) == 1, log_lines


class Collective(Logger):
    """A backend that calls a collective."""

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        from torch.distributed import distributed_c10d

        distributed_c10d._new_process_group_helper()  # type: ignore[call-arg]


def test_a_backend_calling_a_collective_is_told_backends_must_not(log_lines: list[str]) -> None:
    backend = Collective()
    log = RunLog([backend])
    log.active = [backend]
    log._guarded(backend, "train", backend.write, {"kind": "train", "step": 2, "loss": 1.0})
    (warning,) = [line for line in log_lines if "logger Collective failed" in line]
    assert "logging backend Collective (train) called" in warning, warning
    assert "must not call collectives" in warning and "callbacks_all" not in warning, warning
