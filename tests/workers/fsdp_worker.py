"""Worker for tests/test_fsdp.py: the same training under strategy="ddp" and "fsdp".

Usage (under torchrun, 2 ranks)::

    fsdp_worker.py OUT_DIR

Writes ``OUT_DIR/rank<R>.json`` with, for each strategy, the final (gathered) parameters, the
local shard sizes, evaluate()/predict() of an odd-size dev set and the same computed by the
plain gathered model in this process (the one-process result), the best model file; a
bf16 FSDP run's losses; and runs whose first epoch is skipped (its checkpoint holding an
optimizer that never stepped), one of them resumed from that checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from workers.ending import exit_now
from workers.trainer_worker import CLASSES, DIM, ToyData, write_json

from fastdist import AccuracyMetric, Callback, CrossEntropyLoss, DistTrainer, LossMetric, get_rank
from fastdist.callbacks import GradientClipCallback

HIDDEN, N_TRAIN, N_DEV = 32, 40, 13  # dev: 7 + 6 samples, 4 and 3 batches of 2 on 2 ranks


class BlockNet(nn.Module):
    """An MLP whose hidden layers are a ``nn.ModuleList`` (what FSDP shards one by one)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(DIM, HIDDEN, dtype=dtype)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, dtype=dtype) for _ in range(2))
        self.out = nn.Linear(HIDDEN, CLASSES, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x.to(self.inp.weight.dtype)))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h)


class LossLog(Callback):
    """The losses, and which parameters are sharded between forward and backward."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.sharded_in_backward: dict[str, bool] = {}

    def on_backward_begin(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss))
        model = self.trainer.model
        for name in ("inp.weight", "blocks.0.weight"):  # the root's own, a block's
            self.sharded_in_backward[name] = isinstance(model.get_parameter(name), DTensor)


def local_numel(tensors: Any) -> tuple[int, int]:
    """Elements held by this rank and in total (DTensors: the local shard)."""
    local = total = 0
    for t in tensors:
        local += (t.to_local() if isinstance(t, DTensor) else t).numel()
        total += t.numel()
    return local, total


def run(strategy: str, out: Path) -> dict[str, Any]:
    model = BlockNet()
    save = out / strategy
    trainer = DistTrainer(
        ToyData(N_TRAIN),
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
        loss=CrossEntropyLoss(),
        callbacks_all=[GradientClipCallback(clip_value=0.05)],  # small: it really clips
        batch_size_per_gpu=4,
        update_every=2,
        n_epochs=2,
        dev_data=ToyData(N_DEV, seed=1),
        dev_batch_size_per_gpu=2,
        metrics=[AccuracyMetric(), LossMetric(CrossEntropyLoss())],
        metric_key="-loss",
        save_path=str(save),
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
        check_sync_every=2,  # DDP's replicas compared; FSDP has none (no false alarm)
    )
    trainer.train()
    full = trainer.strategy.full_state_dict()  # rank 0: the whole model
    dev = ToyData(N_DEV, seed=1)
    result: dict[str, Any] = {
        "params_local_total": local_numel(trainer.model.parameters()),
        "optim_local_total": local_numel(
            v for s in trainer.optimizer.state.values() for v in s.values() if v.dim() > 0
        ),
        "optimizer_class": type(trainer.optimizer).__name__,
        "weight_decay": trainer.optimizer.param_groups[0]["weight_decay"],
        "eval": trainer.evaluate(dev),
        "predict": trainer.predict(dev),
    }
    if full is not None:
        plain = BlockNet()
        plain.load_state_dict(full)
        result["params"] = torch.cat([p.detach().flatten() for p in plain.parameters()]).tolist()
        with torch.no_grad():  # the one-process results, from the gathered model
            logits = plain(dev.x)
        result["predict_one_process"] = logits.tolist()
        result["eval_one_process"] = {
            "acc": (logits.argmax(1) == dev.target).double().mean().item(),
            "loss": nn.functional.cross_entropy(logits, dev.target).item(),
        }
        best = torch.load(trainer.best_model_path, weights_only=True)
        fresh = BlockNet()
        fresh.load_state_dict(best)  # strict: every key, plain tensors
        result["best_equals_final"] = all(torch.equal(best[k], v) for k, v in full.items())
    return result


def run_bf16() -> dict[str, Any]:
    model = BlockNet()
    log = LossLog()
    trainer = DistTrainer(
        ToyData(N_TRAIN),
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.02),
        loss=CrossEntropyLoss(),
        callbacks_all=[log],
        batch_size_per_gpu=4,
        n_epochs=4,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy="fsdp",
        amp="bf16",
    )
    trainer.train()
    return {
        "losses": log.losses,
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "sharded_in_backward": log.sharded_in_backward,
    }


class Poison(Callback):
    """Epoch 1's losses are not finite: each of its updates is skipped."""

    on = False

    def __init__(self) -> None:
        self.epochs: list[int] = []  # those begun

    def on_epoch_begin(self) -> None:
        self.epochs.append(self.trainer.state.epoch)
        Poison.on = self.trainer.state.epoch == 1


def poisoned(output: torch.Tensor, batch: Any) -> torch.Tensor:
    loss = CrossEntropyLoss()(output, batch)
    return loss * float("nan") if Poison.on else loss


def run_skipped(strategy: str, save: Path, n_epochs: int = 2) -> dict[str, Any]:
    """Epoch 1 skipped (its checkpoint holds an optimizer that never stepped), epoch 2
    trained; resumed from ``save``'s last checkpoint if there is one. The parameters and
    AdamW's step counts at the end."""
    model = BlockNet()
    trainer = DistTrainer(
        ToyData(N_TRAIN),
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        loss=poisoned,
        callbacks_all=[poison := Poison()],
        batch_size_per_gpu=4,
        update_every=2,
        n_epochs=n_epochs,
        on_nonfinite="skip",
        save_path=str(save),
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
    )
    trainer.train("auto")
    full = trainer.strategy.full_state_dict()
    steps = {float(state["step"]) for state in trainer.optimizer.state.values()}
    params = [] if full is None else torch.cat([v.flatten() for v in full.values()]).tolist()
    return {"steps": sorted(steps), "params": params, "epochs": poison.epochs}


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    results = {"rank": get_rank(), "ddp": run("ddp", out), "fsdp": run("fsdp", out)}
    results["bf16"] = run_bf16()
    for strategy in ("ddp", "fsdp"):
        results[f"skipped_{strategy}"] = run_skipped(strategy, out / f"skipped_{strategy}")
    run_skipped("fsdp", out / "resumed", n_epochs=1)  # stops after the skipped epoch
    results["resumed"] = run_skipped("fsdp", out / "resumed")
    write_json(out, results)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
