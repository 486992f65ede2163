"""Hugging Face models in and out: train mode, ``save_model`` and ``python -m fastdist export``
from any strategy, the model's own loss, named fields, ``predict()``, the logged loss.

One 2-rank torchrun world (tests/workers/hf_worker.py) trains a tiny ``GPT2LMHeadModel``
(random init, no download) under DDP and FSDP and exports it every way; the tests here read
its files back as a user would, with transformers, safetensors and the command line. The rest
runs in this process (a world of one).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import make_trainer
from launch import REPO_ROOT, run_python, run_torchrun
from torch import nn

from fastdist import (
    AccuracyMetric,
    Callback,
    CrossEntropyLoss,
    DistTrainer,
    LossMetric,
)
from fastdist.cli import main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from workers.hf_worker import (  # noqa: E402
    Scorer,
    lm_data,
    logged_loss,
    probe,
    scorer_data,
    tiny_config,
)

WORKER = Path(__file__).resolve().parent / "workers" / "hf_worker.py"
GPT2 = transformers.GPT2LMHeadModel


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("hf")
    result = run_torchrun(WORKER, 2, [str(out)], timeout=240, cwd=out)
    paths = [out / f"rank{rank}.json" for rank in range(2)]
    assert all(p.exists() for p in paths), result.describe()
    return out, [json.loads(p.read_text()) for p in paths]


def weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_save_model_reloads_with_identical_logits(world: Any, strategy: str) -> None:
    out, ranks = world
    expected = torch.load(out / strategy / "logits.pt", weights_only=True)
    assert ranks[0][strategy]["saved"] == ranks[1][strategy]["saved"]  # every rank returned
    model = GPT2.from_pretrained(out / strategy / "hf")
    with torch.no_grad():
        assert torch.equal(model(probe()).logits, expected)
    config = json.loads((out / strategy / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"]
    # The one-file formats hold every name of the state_dict (the tied lm_head too).
    whole = torch.load(out / strategy / "model.pt", weights_only=True)
    weights_equal(whole, safetensors_torch.load_file(out / strategy / "model.safetensors"))
    plain = GPT2(tiny_config()).eval()
    plain.load_state_dict(whole)  # strict
    with torch.no_grad():
        assert torch.equal(plain(probe()).logits, expected)


@pytest.mark.slow
def test_the_save_pretrained_idiom_after_fsdp_raises_at_once_naming_save_model(
    world: Any,
) -> None:
    out, ranks = world
    fsdp = [rank["fsdp"]["save_pretrained"] for rank in ranks]
    assert list(fsdp[1]) == ["every_rank"]  # rank 1 skipped `if rank == 0`
    for call in [fsdp[0]["rank0"], fsdp[0]["every_rank"], fsdp[1]["every_rank"]]:
        assert call["error"] == (
            "RuntimeError: FSDPGPT2LMHeadModel.save_pretrained() cannot gather the weights FSDP "
            "sharded over the ranks (a collective: under `if rank == 0` it would wait for the "
            'other ranks forever): call trainer.save_model(dir, format="hf") on every rank '
            "instead; rank 0 writes the folder save_pretrained would"
        )
        assert call["seconds"] < 1
    submodule = fsdp[0]["submodule"]  # model.transformer.save_pretrained: refused alike
    assert submodule["error"].startswith("RuntimeError: GPT2Model.save_pretrained() cannot ")
    assert submodule["seconds"] < 1
    assert not list((out / "fsdp").glob("save_pretrained_*"))  # nothing half-written
    # Under DDP the model is the user's own: the idiom works, with the trained weights.
    ddp = ranks[0]["ddp"]["save_pretrained"]["rank0"]
    assert ddp["error"] is None
    model = GPT2.from_pretrained(out / "ddp" / "save_pretrained_rank0")
    with torch.no_grad():
        assert torch.equal(model(probe()).logits, torch.load(out / "ddp" / "logits.pt"))


@pytest.mark.slow
def test_fsdp_trains_the_model_ddp_trains(world: Any) -> None:
    out, ranks = world
    ddp, fsdp = (torch.load(out / s / "model.pt", weights_only=True) for s in ("ddp", "fsdp"))
    for name in ddp:
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=0, atol=1e-5)
    assert ranks[0]["ddp"]["best_eval"]["loss"] == pytest.approx(
        ranks[0]["fsdp"]["best_eval"]["loss"], abs=1e-6
    )


@pytest.mark.slow
def test_a_from_pretrained_model_is_put_back_in_eval_mode(world: Any) -> None:
    _, ranks = world
    for rank in ranks:
        for strategy in ("ddp", "fsdp"):
            assert not rank[strategy]["arrived_training"]  # from_pretrained: eval mode
            assert not rank[strategy]["ended_training"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_export_of_a_checkpoint_equals_the_gathered_model(
    world: Any, strategy: str, tmp_path: Path
) -> None:
    out, _ = world
    final = torch.load(out / strategy / "final.pt", weights_only=True)  # save_model, gathered
    checkpoints = out / strategy / "checkpoints"  # FSDP: 2 ranks' DCP shards
    # The command line, in a process with no group: the directory's newest checkpoint.
    run_python("-m", ["fastdist", "export", str(checkpoints), str(tmp_path / "m.safetensors")])
    weights_equal(safetensors_torch.load_file(tmp_path / "m.safetensors"), final)
    newest = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step-"))[-1]
    assert main(["export", str(newest), str(tmp_path / "m.pt")]) == 0
    weights_equal(torch.load(tmp_path / "m.pt", weights_only=True), final)


@pytest.mark.slow
def test_best_model_files_carry_the_users_class(world: Any) -> None:
    out, ranks = world
    ddp, fsdp = (Path(ranks[0][s]["best_model_path"]) for s in ("ddp", "fsdp"))
    assert ddp.name.startswith("best_GPT2LMHeadModel_loss_") and ddp.suffix == ".safetensors"
    GPT2(tiny_config()).load_state_dict(safetensors_torch.load_file(ddp))  # strict
    assert fsdp.name.startswith("best_GPT2LMHeadModel_loss_") and fsdp.is_dir()  # format="hf"
    model = GPT2.from_pretrained(fsdp)
    with torch.no_grad():  # load_best_model: the model trained last is the best one
        assert torch.equal(model(probe()).logits, torch.load(out / "fsdp" / "logits.pt"))


@pytest.mark.slow
def test_logged_loss_of_one_process_equals_two_ranks(world: Any) -> None:
    """23 samples: updates of 6, 6, 6, 5; 2 x batch 3 against 1 x batch 3 x update_every 2."""
    _, ranks = world
    one = logged_loss(update_every=2)
    two = {int(step): loss for step, loss in ranks[0]["logged_loss"].items()}
    assert list(two) == [3, 6, 9, 12]
    assert two == pytest.approx(one, abs=1e-6, rel=0)


@pytest.mark.slow
def test_fsdp_evaluates_and_predicts_through_predict(world: Any) -> None:
    _, ranks = world
    for rank in ranks:
        assert rank["predict"]["eval"] == {"acc": 1.0}  # forward's scores would give 0.0
    assert [p["pred"] for p in ranks[0]["predict"]["predict"]] == [0, 0, 0, 0, 1, 1, 1]
    assert ranks[1]["predict"]["predict"] is None


@pytest.mark.slow
def test_the_example_trains_exports_reloads_and_generates(tmp_path: Path) -> None:
    example = REPO_ROOT / "examples" / "hf_causal_lm.py"
    result = run_torchrun(example, 2, ["--epochs", "1"], cwd=tmp_path, timeout=180)
    for strategy in ("ddp", "fsdp"):
        assert re.search(rf"{strategy}: best dev loss [\d.]+, perplexity [\d.]+", result.output)
        assert f"{strategy}: reloaded hf_out/{strategy}/model, identical logits: True" in (
            result.output
        )
        assert f"{strategy}: generated 'Return the " in result.output
        assert (tmp_path / "hf_out" / strategy / "model" / "model.safetensors").exists()
        assert list((tmp_path / "hf_out" / strategy).glob("best_GPT2LMHeadModel_loss_*"))


# ----- in this process -----


class DropoutNet(nn.Module):
    """A linear layer behind dropout; records the dropout's mode at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4, 2)
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.modes.append(self.drop.training)
        return {"pred": self.fc(self.drop(x))}


def test_an_eval_mode_model_trains_with_dropout_on(no_dist_env: None) -> None:
    model = DropoutNet().eval()  # as from_pretrained returns a model
    trainer = make_trainer(Callback(), model=model, optimizer=None)
    trainer.train(resume=False)  # 6 updates, then the dev set's 6 batches
    assert model.modes == [True] * 6 + [False] * 6
    assert not model.training and not model.drop.training  # put back as it came
    model.train()
    trainer.evaluate()
    assert model.modes[-6:] == [False] * 6
    assert model.training and model.drop.training  # evaluation puts it back


class ModeAtBatchBegin(Callback):
    """Records the model's mode when each micro-batch is announced."""

    def __init__(self) -> None:
        self.modes: list[bool] = []

    def on_batch_begin(self, batch: Any) -> None:
        self.modes.append(self.trainer.model.training)


def test_on_batch_begin_sees_train_mode_from_the_first_micro_batch(no_dist_env: None) -> None:
    # Issue 28: an eval-mode model (from_pretrained's) was switched after on_batch_begin, so a
    # hook reading the mode saw eval on the first micro-batch.
    seen = ModeAtBatchBegin()
    trainer = make_trainer(seen, model=DropoutNet().eval(), optimizer=None, update_every=2)
    trainer.train(resume=False)  # 6 micro-batches, 3 updates
    assert seen.modes == [True] * 6


def test_evaluation_and_predict_use_the_models_predict(no_dist_env: None) -> None:
    data = scorer_data(8)
    trainer = DistTrainer(
        data, Scorer(), loss=lambda output, batch: output["pred"].mean(), metrics=AccuracyMetric()
    )
    assert trainer.evaluate(data) == {"acc": 1.0}  # forward's sigmoid scores would give 0.0
    assert trainer.predict(data) == [{"pred": int(s["target"])} for s in data]


def test_the_models_own_loss_named_fields_and_dev_perplexity(no_dist_env: None) -> None:
    torch.manual_seed(0)
    model = GPT2(tiny_config())
    train, dev = lm_data(8), lm_data(5, seed=1)
    trainer = DistTrainer(train, model, loss=CrossEntropyLoss(), device="cpu", use_tqdm=False)
    with pytest.raises(KeyError, match=r"'pred' .* pass the name to read as pred=\.\.\., e\.g\. "):
        trainer.train(resume=False)
    batch = _stack(train[:2])
    output = model(**batch)  # a transformers ModelOutput: fields read by name
    named = CrossEntropyLoss(pred="logits", target="labels")(output, batch)
    flat = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), batch["labels"].flatten())
    assert torch.equal(named, flat)
    trainer = DistTrainer(
        train,
        model,
        loss=None,  # the model's own loss (it shifts the labels)
        dev_data=dev,
        dev_batch_size_per_gpu=2,  # batches of 2, 2, 1: weighted by their sizes
        metrics=LossMetric(target="labels"),
        device="cpu",
        use_tqdm=False,
    )
    assert trainer.train(resume=False)["steps"] == 1
    model.eval()
    with torch.no_grad():
        losses = [model(**batch).loss for batch in (_stack(dev[i : i + 2]) for i in (0, 2, 4))]
    expected = (2 * losses[0] + 2 * losses[1] + losses[2]) / 5
    result = trainer.evaluate()
    assert result["loss"] == pytest.approx(float(expected), abs=1e-6)
    assert math.exp(result["loss"]) == pytest.approx(math.exp(float(expected)), rel=1e-6)


def _stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def test_save_model_refuses_bad_arguments(no_dist_env: None, tmp_path: Path) -> None:
    trainer = make_trainer(Callback())
    with pytest.raises(ValueError, match="format must be one of 'torch', 'safetensors', 'hf'"):
        trainer.save_model(tmp_path / "m.onnx", format="onnx")
    with pytest.raises(ValueError, match=r"format='hf' writes the folder of the model's save_"):
        trainer.save_model(tmp_path / "hf", format="hf")  # a plain nn.Module
    with pytest.raises(ValueError, match=r"is a folder, and format='torch' writes one file"):
        trainer.save_model(tmp_path)
    (tmp_path / "file").write_text("x")
    model = GPT2(tiny_config())
    hf_trainer = DistTrainer(lm_data(8), model, device="cpu", use_tqdm=False)
    with pytest.raises(ValueError, match=r"is a file, and format='hf' writes a folder"):
        hf_trainer.save_model(tmp_path / "file", format="hf")
    with pytest.raises(TypeError, match="path must be a file or folder path"):
        trainer.save_model(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"best_model_format='hf' writes the folder"):
        make_trainer(Callback(), best_model_format="hf")
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing written


def test_save_model_never_writes_into_a_checkpoint_directory(
    no_dist_env: None, tmp_path: Path
) -> None:
    """It replaced a checkpoint file or the manifest, and the next resume failed."""
    trainer = make_trainer(Callback(), save_path=str(tmp_path / "save"), n_epochs=1)
    trainer.train()
    checkpoints = tmp_path / "save" / "checkpoints"
    before = {p.name: p.read_bytes() for p in checkpoints.iterdir()}
    step = next(name for name in before if name.startswith("step-"))
    for path in [checkpoints / step, checkpoints / "manifest.json", checkpoints / "model.pt"]:
        with pytest.raises(ValueError, match="lies in the checkpoint directory .*: pass a path"):
            trainer.save_model(path)
    hf_trainer = DistTrainer(lm_data(8), GPT2(tiny_config()), device="cpu", use_tqdm=False)
    with pytest.raises(ValueError, match="lies in the checkpoint directory .*: pass a path"):
        hf_trainer.save_model(checkpoints, format="hf")  # the folder itself
    assert {p.name: p.read_bytes() for p in checkpoints.iterdir()} == before
    assert trainer.save_model(tmp_path / "save" / "model.pt") == str(tmp_path / "save/model.pt")


def test_save_model_into_a_folder_keeps_its_other_files(no_dist_env: None, tmp_path: Path) -> None:
    model = GPT2(tiny_config())
    trainer = DistTrainer(lm_data(8), model, device="cpu", use_tqdm=False)
    folder = tmp_path / "gpt2"
    assert trainer.save_model(folder, format="hf") == str(folder)  # a new folder: one rename
    (folder / "tokenizer.json").write_text("{}")  # the user's
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # tied: the embedding too
    trainer.save_model(folder, format="hf")
    assert sorted(os.listdir(folder)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]
    reloaded = GPT2.from_pretrained(folder)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


def test_export_explains_what_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path), str(tmp_path / "m.pt")]) == 1
    assert "is neither a checkpoint nor a checkpoint directory" in capsys.readouterr().err
    torch.save({"weights": [1, 2]}, tmp_path / "other.pt")
    assert main(["export", str(tmp_path / "other.pt"), str(tmp_path / "m.pt")]) == 1
    assert "is not a checkpoint fastdist wrote, nor a state_dict" in capsys.readouterr().err
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")  # a best model: converted
    assert main(["export", str(tmp_path / "plain.pt"), str(tmp_path / "p.safetensors")]) == 0
    assert safetensors_torch.load_file(tmp_path / "p.safetensors")["w"].tolist() == [1.0, 1.0]
    assert main(["export", str(tmp_path / "plain.pt"), str(tmp_path / "plain.pt")]) == 1
    assert "is the checkpoint itself" in capsys.readouterr().err


@pytest.fixture
def umask_027() -> Any:
    previous = os.umask(0o027)  # group may read, others nothing: not safetensors' 0o600
    yield
    os.umask(previous)


def modes(folder: Path) -> dict[str, int]:
    """The permission bits of every file under ``folder``, by path relative to it."""
    return {
        str(p.relative_to(folder)): p.stat().st_mode & 0o777
        for p in folder.rglob("*")
        if p.is_file()
    }


def test_safetensors_files_honour_the_umask(
    no_dist_env: None, umask_027: None, tmp_path: Path
) -> None:
    model = GPT2(tiny_config())
    trainer = DistTrainer(
        lm_data(4),
        model,
        dev_data=lm_data(2, seed=1),
        metrics=LossMetric(target="labels"),
        metric_key="-loss",
        save_path=str(tmp_path / "save"),
        best_model_format="hf",
        device="cpu",
        use_tqdm=False,
    )
    trainer.train(resume=False)  # the best model: a save_pretrained folder
    trainer.save_model(tmp_path / "out" / "m.safetensors", format="safetensors")
    trainer.save_model(tmp_path / "out" / "hf", format="hf")
    checkpoints = str(tmp_path / "save" / "checkpoints")
    assert main(["export", checkpoints, str(tmp_path / "out" / "e.safetensors")]) == 0
    make_trainer(Callback(), save_path=str(tmp_path / "st"), best_model_format="safetensors").train(
        resume=False
    )
    files = {**modes(tmp_path / "out"), **modes(tmp_path / "save"), **modes(tmp_path / "st")}
    # save_model's file and folder, export's file, the best models of both formats
    assert len([name for name in files if name.endswith(".safetensors")]) == 5
    assert {name: mode for name, mode in files.items() if mode != 0o640} == {}
