"""TensorBoardCallback: in-process trainings read back with tensorboard's EventAccumulator."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import make_trainer
from torch import nn

from fastdist.callbacks.tensorboard import TensorBoardCallback

# 24 samples, batch 4: 6 updates per epoch; 2 epochs; the loss is logged every 2 updates.
N_EPOCHS, PRINT_EVERY = 2, 2
TRAIN_STEPS = [2, 4, 6, 8, 10, 12]
EVAL_STEPS = [6, 12]


def read_events(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def steps(events: Any, tag: str) -> list[int]:
    return [event.step for event in events.Scalars(tag)]


@pytest.mark.usefixtures("no_dist_env")
def test_scalars_and_hparams_are_written(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    callback = TensorBoardCallback(tmp_path / "tb", hparams={"model": "linear", "seed": None})
    result = make_trainer(callback, n_epochs=N_EPOCHS).train()
    assert callback.writer is None, "closed at train end"
    events = read_events(tmp_path / "tb")
    scalars = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "dev/acc", "best/acc", "hparam/best_acc"}
    times = {f"time/{part}_ms/rank0" for part in ("update", "data", "compute", "collective")}
    assert expected | times | {"hparam/final_loss"} == scalars
    assert steps(events, "time/update_ms/rank0") == TRAIN_STEPS
    assert steps(events, "train/loss") == TRAIN_STEPS
    assert steps(events, "train/lr") == TRAIN_STEPS
    assert all(event.value == pytest.approx(0.05) for event in events.Scalars("train/lr"))
    assert steps(events, "dev/acc") == EVAL_STEPS
    best = events.Scalars("best/acc")
    assert best[-1].value == pytest.approx(result["best_eval"]["acc"])
    assert set(steps(events, "best/acc")) <= set(EVAL_STEPS)
    final = events.Scalars("hparam/best_acc")
    assert [(e.step, e.value) for e in final] == [(12, pytest.approx(result["best_eval"]["acc"]))]
    assert "hparams/text_summary" in events.Tags()["tensors"]
    table = events.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    for row in ("| world_size | 1 |", "| global_batch | 4 |", "| optimizer | SGD |"):
        assert row in table
    assert "| model | linear |" in table and "| seed | None |" in table  # the extra hparams


@pytest.mark.usefixtures("no_dist_env")
def test_a_failing_run_is_flushed_and_closed(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    calls = []

    def loss(output: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("deliberate failure")
        return nn.functional.cross_entropy(output["pred"], batch[-1])

    callback = TensorBoardCallback(tmp_path / "tb", flush_secs=3600)
    with pytest.raises(RuntimeError, match="deliberate failure"):
        make_trainer(callback, n_epochs=N_EPOCHS, loss=loss).train()
    assert callback.writer is None
    events = read_events(tmp_path / "tb")
    assert steps(events, "train/loss") == [2, 4]  # flushed on the exception
    assert "hparam/best_acc" not in events.Tags()["scalars"]


@pytest.mark.usefixtures("no_dist_env")
def test_missing_tensorboard_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    callback = TensorBoardCallback(tmp_path / "tb")
    with pytest.raises(ImportError, match=r"pip install tensorboard.*fastdist\[tensorboard\]"):
        make_trainer(callback, n_epochs=N_EPOCHS).train()
    assert not (tmp_path / "tb").exists()
