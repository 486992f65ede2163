"""Every option with every other: a pairwise combination matrix, each run held to the invariants.

The options (tests/workers/matrix_worker.py ``OPTIONS``): strategy (ddp, fsdp), update_every
(1, 3), data (map-style of an uneven size, token batches, a stream, a user sampler, drop_last),
amp (none, bf16), resume (none; a kill mid-epoch and torchrun's restart; a move from 2 ranks
to 1 process), stop (none, early stopping, request_stop, SIGTERM), DDP's communication (none,
PowerSGD, local SGD), check_sync_every (0, 2), and checkpoints with or without save_path. Every
pair of values of two options is in at least one run (tests/pairwise.py), plus three plain runs
with one-process references. One torchrun world of 2 ranks runs them all (restarted by torchrun
after each kill and pre-emption), one plain process continues the moved runs and the
references. Every run is checked for:

* every sample once per completed epoch (at most once with drop_last);
* the same weights as one process with twice update_every, where the arithmetic says so;
* resumed == uninterrupted (a twin run without the kill or SIGTERM), bit for bit;
* the best weights loaded at the end (the final model scores the best evaluation's loss);
* early stopping and stop requests stopping before the end;
* no warning and no error in a healthy run (only the warnings its resume explains);
* a bounded time (the launches' timeouts).

The pairs the matrix leaves out are refused with a clear error (the last tests).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_python, run_torchrun
from torch import nn
from workers.matrix_worker import (
    EPOCHS,
    N,
    Sequences,
    Stream,
    cases,
    interrupted,
    one_process_equal,
)

from fastdist import DDP, FSDP, DistTrainer

WORKER = Path(__file__).resolve().parent / "workers" / "matrix_worker.py"
CASES = cases()
RESTARTS = sum((c["resume"] == "kill") + (c["stop"] == "sigterm") for c in CASES.values())
#: Warnings a run that moves to one process explains; any other warning or error fails it.
MOVED = "resuming a 2-process run on 1 processes"
RESTARTED_EPOCH = "the streaming train_data cannot continue its interrupted epoch"
PER_RANK_RESTART = "the checkpoint was written by 2 processes, not 1"
# The slow-rank report reads the machine's load (2 ranks on 2 shared cores); test_timing.py
# holds it, and that a healthy run leaves it quiet.
SLOW_RANK = "slower than the median"


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both worlds run, once for the module."""
    out = tmp_path_factory.mktemp("matrix")
    run_torchrun(WORKER, 2, ["two", str(out)], timeout=420, max_restarts=RESTARTS)
    run_python(WORKER, ["one", str(out)], timeout=180)
    return out


def result(out: Path, run: str, world: str, rank: int = 0) -> dict[str, Any]:
    path = out / run / f"result.{world}.rank{rank}.json"
    assert path.is_file(), f"{run}: no result of the {world} world"
    return json.loads(path.read_text())


def final(out: Path, name: str) -> dict[str, Any]:
    """Where a case ended: the one-process continuation of a moved run, else rank 0's."""
    return result(out, name, "one" if CASES[name]["resume"] == "resize" else "two")


def kept_updates(out: Path, run: str) -> list[dict[str, Any]]:
    """The updates that count, of every rank: each attempt's up to where the next resumed."""
    records = [
        json.loads(line)
        for path in sorted((out / run).glob("ids.rank*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    starts = {r["attempt"]: r["start"] for r in records}  # "two-0" < "two-1" < ... < "one-0"
    order = sorted(starts, key=lambda a: (a.startswith("one"), int(a.split("-")[1])))
    ends = dict(zip(order, [starts[a] for a in order[1:]] + [None], strict=True))
    return [r for r in records if ends[r["attempt"]] is None or r["step"] <= ends[r["attempt"]]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_sample_once_per_completed_epoch(name: str, out: Path) -> None:
    case, updates = CASES[name], kept_updates(out, name)
    complete = range(1, final(out, name)["complete_epochs"] + 1)
    moved_epoch = None
    if case["resume"] == "resize" and case["data"] == "stream":  # restarts its epoch (warned)
        moved_epoch = next(u["epoch"] for u in updates if u["attempt"].startswith("one"))
    assert complete, f"{name}: no epoch completed"
    for epoch in complete:
        if epoch == moved_epoch:
            continue
        seen = Counter(i for u in updates if u["epoch"] == epoch for i in u["ids"])
        assert max(seen.values()) == 1, f"{name} epoch {epoch}: a sample twice"
        if case["data"] == "drop_last":  # 30 of 61 samples per rank, batches of 2: 60 kept
            assert len(seen) == N - 1, f"{name} epoch {epoch}: {len(seen)} samples"
        elif case["data"] == "sampler":  # the user's sampler gives the first 60 positions
            assert sorted(seen) == list(range(N - 1)), f"{name} epoch {epoch}"
        else:
            assert sorted(seen) == list(range(N)), f"{name} epoch {epoch}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [n for n, c in CASES.items() if interrupted(c) and c["resume"] != "resize"]
)
def test_resumed_equals_uninterrupted(name: str, out: Path) -> None:
    """Killed or pre-empted, resumed by torchrun's restart: the straight twin's run, bit for
    bit. (A run moved to one process trains other updates: its samples are checked above.)"""
    got, want = result(out, name, "two"), result(out, f"{name}~straight", "two")
    assert got["result"]["steps"] == want["result"]["steps"]
    assert got["weights"] == want["weights"], f"{name}: weights differ from the straight run"
    assert got["result"]["best_eval"] == want["result"]["best_eval"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if one_process_equal(c)])
def test_two_ranks_equal_one_process(name: str, out: Path) -> None:
    two, one = result(out, name, "two"), result(out, f"{name}~one", "one")
    assert two["result"]["steps"] == one["result"]["steps"]
    diff = (torch.tensor(two["weights"]) - torch.tensor(one["weights"])).abs().max().item()
    assert diff < 1e-9, f"{name}: 2 ranks and 1 process differ by {diff:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_best_model_is_loaded_and_stops_stop(name: str, out: Path) -> None:
    case, last = CASES[name], final(out, name)
    best = last["result"]["best_eval"]
    assert best is not None, f"{name}: never evaluated"
    assert last["dev_loss"] == pytest.approx(best["loss"], rel=1e-9), f"{name}: not the best"
    epochs = 2 if case["stop"] in ("early", "request") else EPOCHS
    assert last["complete_epochs"] == epochs, f"{name}: stop {case['stop']!r} not kept"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_no_warning_without_a_reason(name: str, out: Path) -> None:
    """The attempt that finished logs no WARNING or ERROR, but what its move explains (and
    the slow-rank report, which times the machine)."""
    case = CASES[name]
    expected = [SLOW_RANK]
    if case["resume"] == "resize":
        expected.append(MOVED)
        if case["data"] == "stream":
            expected.append(RESTARTED_EPOCH)
        if case["comm"] != "none":
            expected.append(PER_RANK_RESTART)
    runs = [(name, "one" if case["resume"] == "resize" else "two")]
    if interrupted(case):
        runs.append((f"{name}~straight", "two"))
    for run, world in runs:
        for rank in range(1 if world == "one" else 2):
            lines = result(out, run, world, rank)["logged"]
            unexplained = [line for line in lines if not any(e in line for e in expected)]
            assert not unexplained, f"{run} rank {rank}: {unexplained}"


# ----- the pairs the matrix leaves out are refused -----


def test_fsdp_has_no_ddp_communication_options() -> None:
    with pytest.raises(TypeError, match="comm_hook"):
        FSDP(comm_hook="powersgd")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="average_every"):
        FSDP(average_every=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="comm_hook and average_every both set DDP's hook"):
        DDP(comm_hook="powersgd", average_every=2)


@pytest.mark.usefixtures("no_dist_env")
@pytest.mark.parametrize(
    "options, words",
    [
        ({"sampler": range(10)}, "sampler= and batch_sampler= do not apply to a streaming"),
        ({"batch_sampler": [[0, 1]]}, "sampler= and batch_sampler= do not apply to a streaming"),
        (
            {"on_nonfinite": "skip", "strategy": DDP(average_every=2)},
            "on_nonfinite='skip' needs the gradients all-reduced every update",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused(options: dict[str, Any], words: str) -> None:
    model = nn.Linear(2, 2)
    data = Stream() if "sampler" in options or "batch_sampler" in options else Sequences(4)
    with pytest.raises((TypeError, ValueError), match=words):
        DistTrainer(data, model, loss=nn.CrossEntropyLoss(), device="cpu", **options)
