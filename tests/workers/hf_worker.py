"""Worker for tests/test_hf.py: a Hugging Face model trained and exported under DDP and FSDP.

Usage (under torchrun, 2 ranks)::

    hf_worker.py OUT_DIR

Rank 0 writes a tiny ``GPT2LMHeadModel`` (random init, no download) with ``save_pretrained``;
every rank loads it with ``from_pretrained`` (eval mode, as from the hub). For each strategy
it trains 2 epochs on 21 sequences (uneven over 2 ranks) with the model's own loss, keeps the
best model and writes checkpoints; ``save_model`` writes the final weights (those of the last
checkpoint) from a hook, and after training, with the best model loaded, in each format;
rank 0 saves that model's logits on fixed inputs. Then the logged loss of a float64
toy model on 23 samples, and evaluation through a model's ``predict()`` under FSDP. Writes
``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from workers.ending import exit_now

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from workers.trainer_worker import ToyData, ToyNet, write_json

from fastdist import (
    AccuracyMetric,
    Callback,
    CrossEntropyLoss,
    DistTrainer,
    LossMetric,
    get_rank,
    rank_zero_first,
)

VOCAB, LENGTH, N_TRAIN = 48, 12, 21


def tiny_config() -> GPT2Config:
    """A 2-layer GPT-2 of 27k parameters; its dropouts (0.1) stay on."""
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )


def lm_data(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` random token sequences as HF batches want them: ``input_ids`` and ``labels``."""
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": t, "labels": t} for t in tokens]


def probe() -> torch.Tensor:
    """The inputs whose logits are compared after a reload."""
    return torch.stack([sample["input_ids"] for sample in lm_data(3, seed=7)])


class LoggedLoss(Callback):
    """Every logged training loss, by step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_step_end(self) -> None:
        state = self.trainer.state  # a log step's loss comes an update late, with its step
        if state.loss is not None and state.loss_step is not None:
            self.losses[state.loss_step] = state.loss


class SaveAtEnd(Callback):
    """``save_model`` from a hook (every rank: ``callbacks_all``) once the last epoch's
    checkpoint is written, before the best model is loaded back."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self) -> None:
        self.trainer.save_model(self.path)


def train_hf(strategy: str, pretrained: Path, out: Path) -> dict[str, Any]:
    model = GPT2LMHeadModel.from_pretrained(pretrained)
    arrived_training = model.training
    torch.manual_seed(get_rank())  # each rank its own dropout
    trainer = DistTrainer(
        lm_data(N_TRAIN),
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        loss=None,  # the model's own (shifted) loss
        callbacks_all=[SaveAtEnd(out / "final.pt")],
        batch_size_per_gpu=4,
        n_epochs=2,
        dev_data=lm_data(9, seed=1),
        metrics=LossMetric(target="labels"),
        metric_key="-loss",
        save_path=str(out),
        best_model_format="hf" if strategy == "fsdp" else "safetensors",
        strategy=strategy,
        use_tqdm=False,
        device="cpu",
        timeout=60,
    )
    result = trainer.train()
    ended_training = model.training
    with torch.no_grad():
        logits = model(probe()).logits  # FSDP: a collective, every rank runs it
    if trainer.is_master:
        torch.save(logits, out / "logits.pt")
    spellings = save_pretrained_idiom(model, out, every_rank=strategy == "fsdp")
    names = {"hf": "hf", "torch": "model.pt", "safetensors": "model.safetensors"}
    paths = {format: trainer.save_model(out / name, format) for format, name in names.items()}
    return {
        "arrived_training": arrived_training,
        "ended_training": ended_training,
        "best_eval": result["best_eval"],
        "best_model_path": trainer.best_model_path,
        "saved": paths,
        "save_pretrained": spellings,
    }


def save_pretrained_idiom(model: GPT2LMHeadModel, out: Path, every_rank: bool) -> dict[str, Any]:
    """``model.save_pretrained(dir)`` after training, under ``if rank == 0`` and then (with
    ``every_rank``) on every rank: the error each call raised (``None``: none), its seconds."""
    spellings: dict[str, Any] = {}
    for spelling in ("rank0", "submodule", "every_rank") if every_rank else ("rank0",):
        if spelling in ("rank0", "submodule") and get_rank() != 0:
            continue
        start = time.monotonic()
        part = model.transformer if spelling == "submodule" else model  # a PreTrainedModel too
        try:
            part.save_pretrained(out / f"save_pretrained_{spelling}")
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        spellings[spelling] = {"error": error, "seconds": time.monotonic() - start}
    return spellings


def logged_loss(update_every: int = 1) -> dict[int, float]:
    """Logged losses (by step) of batches of 3 on 23 samples: on 2 ranks, updates of 6, 6, 6,
    5 samples; on 1 process with ``update_every=2`` the same updates."""
    log = LoggedLoss()
    model = ToyNet()
    trainer = DistTrainer(
        ToyData(23),
        model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.3),
        loss=CrossEntropyLoss(),
        callbacks_master=[log],
        batch_size_per_gpu=3,
        update_every=update_every,
        n_epochs=3,
        print_every=3,
        use_tqdm=False,
        device="cpu",
    )
    trainer.train(resume=False)
    return log.losses


class Scorer(nn.Module):
    """``forward`` gives sigmoid scores (what training's loss reads); ``predict`` the class
    (what evaluation reads, as fastNLP's models did)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(1, 1), nn.Linear(1, 1)])  # FSDP shards them
        with torch.no_grad():
            for block in self.blocks:
                block.weight.fill_(1.0)
                block.bias.zero_()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = x
        for block in self.blocks:
            h = block(h)
        return {"pred": torch.sigmoid(h).squeeze(-1)}

    def predict(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": (self(x)["pred"] > 0.5).long()}


def scorer_data(n: int) -> list[dict[str, torch.Tensor]]:
    """``x`` in [-1, 1] without 0; ``target`` is whether it is positive."""
    xs = torch.linspace(-1, 1, n + 1)
    xs = xs[xs != 0][:n]
    return [{"x": x.reshape(1), "target": (x > 0).long()} for x in xs]


def evaluate_with_predict() -> dict[str, Any]:
    """An FSDP-sharded model evaluated and predicted with through its predict()."""
    model = Scorer()
    trainer = DistTrainer(
        scorer_data(8),
        model,
        loss=lambda output, batch: output["pred"].mean(),
        metrics=AccuracyMetric(),
        strategy="fsdp",
        use_tqdm=False,
        device="cpu",
        dev_batch_size_per_gpu=2,
    )
    data = scorer_data(7)  # 4 and 3 samples: 2 and 2 batches
    return {"eval": trainer.evaluate(data), "predict": trainer.predict(data, batch_size_per_gpu=2)}


def main(out: Path) -> None:
    pretrained = out / "pretrained"
    with rank_zero_first(local=False):
        if get_rank() == 0 and not pretrained.exists():
            torch.manual_seed(0)
            GPT2LMHeadModel(tiny_config()).save_pretrained(pretrained)
    results: dict[str, Any] = {s: train_hf(s, pretrained, out / s) for s in ("ddp", "fsdp")}
    results["logged_loss"] = {str(step): loss for step, loss in logged_loss().items()}
    results["predict"] = evaluate_with_predict()
    write_json(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_now()
