"""TensorBoardCallback (a TensorBoardLogger run from callbacks_master): in-process trainings
read back with tensorboard's EventAccumulator."""

from __future__ import annotations

import re
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
    make_trainer(callback, n_epochs=N_EPOCHS).train()
    assert callback.logger.writer is None, "closed at train end"
    events = read_events(tmp_path / "tb")
    scalars = set(events.Tags()["scalars"])
    expected = {"loss", "lr", "epoch", "samples_per_s", "memory_mb", "dev/acc"}
    times = {f"time/{part}_ms/rank0" for part in ("update", "data", "compute", "collective")}
    assert expected | times == scalars  # log.jsonl's names
    for tag in ("time/update_ms/rank0", "loss", "lr", "epoch"):
        assert steps(events, tag) == TRAIN_STEPS
    assert all(event.value == pytest.approx(0.05) for event in events.Scalars("lr"))
    assert steps(events, "dev/acc") == EVAL_STEPS
    assert "options/text_summary" in events.Tags()["tensors"]
    table = events.Tensors("options/text_summary")[0].tensor_proto.string_val[0].decode()
    for row in ("| world_size | 1 |", "| global_batch | 4 |", "| print_every | 2 |"):
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
    assert callback.logger.writer is None
    events = read_events(tmp_path / "tb")
    # Flushed on the exception; log step 4's loss is read after update 5, which failed.
    assert steps(events, "loss") == [2]


@pytest.mark.usefixtures("no_dist_env")
def test_missing_tensorboard_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_lines: list[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    callback = TensorBoardCallback(tmp_path / "tb")
    assert make_trainer(callback, n_epochs=N_EPOCHS).train()["steps"] == 12  # training goes on
    (warning,) = [line for line in log_lines if "TensorBoardLogger failed" in line]
    assert re.search(r"pip install tensorboard.*fastdist\[tensorboard\]", warning)
    assert not (tmp_path / "tb").exists()
