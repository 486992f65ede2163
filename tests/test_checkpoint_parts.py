"""Checkpoints as named parts, in one process with real files: what a checkpoint holds, what a
resumed run inherits (and what it must not), format-1 checkpoints, mismatched strategies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from workers.trainer_worker import ToyData, make_trainer, on

from fastdist.callbacks import WarmupCallback
from fastdist.checkpoint import GATHERED, REPLICATED, Checkpointer
from fastdist.checkpoint.rng import rng_state
from fastdist.metrics import Metric

pytestmark = pytest.mark.usefixtures("no_dist_env")


def stop_at(step: int) -> Any:
    """A callback asking to stop after update ``step``."""

    def request(trainer: Any) -> None:
        if trainer.state.global_step == step:
            trainer.request_stop()

    return on("on_step_end", request)


def test_a_stop_agreed_at_a_checkpoint_is_not_inherited(tmp_path: Path) -> None:
    """The stop asked for at update 3 is agreed at update 3's checkpoint, which holds the
    position but not the stop: the resumed run, given more epochs, trains to its end."""
    first = make_trainer(
        24, save_path=str(tmp_path), checkpoint_every=3, callbacks_all=[stop_at(3)]
    )
    assert first.train()["steps"] == 3
    saved = torch.load(tmp_path / "checkpoints" / "step-00000003.pt", weights_only=True)
    assert saved["format"] == 2 and saved["parts"]["trainer"]["global_step"] == 3
    assert "stop_requested" not in saved["parts"]["trainer"]
    resumed = make_trainer(24, save_path=str(tmp_path), checkpoint_every=3, n_epochs=2)
    result = resumed.train()
    assert result["steps"] == resumed.state.total_steps == 6  # 24 samples, batch 8: 3 a epoch
    assert not resumed.state.stop_requested


def test_a_checkpoint_holds_every_registered_part(tmp_path: Path) -> None:
    make_trainer(24, save_path=str(tmp_path), callbacks_all=[WarmupCallback(warmup=2)]).train()
    saved = torch.load(tmp_path / "checkpoints" / "step-00000003.pt", weights_only=True)
    assert set(saved["parts"]) == {
        "model",
        "optimizer",
        "trainer",
        "precision",
        "callbacks",
        "best_model",
    }
    assert set(saved["per_rank"]) == {"strategy", "data", "rng"}
    assert saved["sharded"] == [] and saved["world_size"] == 1
    assert saved["parts"]["callbacks"] == {
        "all": {"WarmupCallback#0": {"base_lrs": [0.1]}},
        "master": {},  # the JSON log keeps no state
    }


def test_a_format_1_checkpoint_still_loads(tmp_path: Path) -> None:
    """The flat layout fastdist wrote before named parts (format 1) resumes."""
    donor = make_trainer(24, n_epochs=1, callbacks_all=[WarmupCallback(warmup=2)])
    donor.train()
    trainer_state = donor.state.state_dict()
    old = {
        "format": 1,
        "model": donor.model.state_dict(),
        "optimizer": donor.optimizer.state_dict(),
        "callbacks_all": [{"base_lrs": [0.1]}],
        "callbacks_master": [],
        "trainer": dict(trainer_state, stop_requested=True, n_epochs=1),  # as format 1 saved it
        "precision": {},
        "ddp": {},
        "best_model_path": None,
        "world_size": 1,
        "seed": 0,
        "rng": [rng_state()],
        "data": [None],
    }
    path = tmp_path / "format1.pt"
    torch.save(old, path)
    warmup = WarmupCallback(warmup=2)
    resumed = make_trainer(24, n_epochs=2, callbacks_all=[warmup])
    result = resumed.train(resume=str(path))
    assert result["steps"] == 6, "epoch 2 trained, the old stop flag ignored"
    assert warmup.base_lrs == [0.1]


def test_a_checkpoint_of_another_strategy_is_refused_by_name(tmp_path: Path) -> None:
    make_trainer(24, save_path=str(tmp_path)).train()  # DDP: the model in the file
    sharded = make_trainer(24, save_path=str(tmp_path), n_epochs=2, strategy="fsdp")
    with pytest.raises(ValueError, match="holds 'model' as a replicated state, but this run"):
        sharded.train()


class FirstIsBest(Metric):
    """Scores every evaluation lower than the one before: the first is the best."""

    keys = ("score",)
    evaluations = 0

    def reset(self) -> None:
        FirstIsBest.evaluations += 1

    def update(self, output: Any, batch: Any) -> None:
        pass

    def state(self) -> torch.Tensor:
        return torch.tensor([float(FirstIsBest.evaluations)], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        return {"score": -float(state[0])}


def test_the_best_model_kept_in_memory_survives_a_resume(tmp_path: Path) -> None:
    """save_path=None, checkpoint_dir=...: the best weights live in memory on rank 0; the
    checkpoint keeps them, so the resumed run ends with epoch 1's weights, its best."""
    checkpoints = str(tmp_path / "checkpoints")
    options: dict[str, Any] = dict(
        dev_data=ToyData(8), metrics=FirstIsBest(), checkpoint_dir=checkpoints
    )
    first = make_trainer(24, n_epochs=1, **options)
    first.train()
    best = {k: v.clone() for k, v in first.model.state_dict().items()}  # epoch 1's weights
    resumed = make_trainer(24, n_epochs=3, **options)
    result = resumed.train()
    assert result["best_epoch"] == 1 and result["steps"] == 9
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, best[name]), f"{name}: not the best model of epoch 1"


class Box:
    """A part holding one value."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


@pytest.mark.parametrize("saved_as, read_as", [(GATHERED, REPLICATED), (REPLICATED, GATHERED)])
def test_a_gathered_state_and_a_replicated_one_read_each_other(
    tmp_path: Path, saved_as: str, read_as: str
) -> None:
    """A pipeline's whole model (gathered from its stages) is saved where a DDP run's is, so
    either resumes the other's checkpoint."""
    writer = Checkpointer(str(tmp_path), every=1, keep=1)
    writer.register("model", Box(3), saved_as)
    writer.save(1)
    reader, box = Checkpointer(str(tmp_path), every=1, keep=1), Box(0)
    reader.register("model", box, read_as)
    assert reader.restore("auto") is not None and box.value == 3
