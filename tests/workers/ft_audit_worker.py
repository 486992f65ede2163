"""One replica group's process for tests/test_ft_audit.py (issue 33's second audit).

``ft_audit_worker.py OUT [options]``, launched by ``python -m fastdist ft``. A float64 linear
model on dict samples that name themselves. Every attempt of every rank appends its
micro-batches and updates to ``OUT/group<G>.rank<R>.attempt<A>.jsonl`` and writes ``...json``
at its end (lost samples per epoch, ``train()``'s result, the final parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from workers.ending import exit_now
from workers.ft_rules_worker import Records, mse

import fastdist
from fastdist import DistTrainer
from fastdist.callbacks import Callback, LRSchedulerCallback
from fastdist.strategies import DDP, FSDP


class Items(Dataset):
    def __init__(self, n: int, nan: int = -1) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.5
        if nan >= 0:
            self.y[nan] = float("nan")  # a bad label: its batch's loss is NaN

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "idx": i}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8).double()
        self.out = nn.Linear(8, 1).double()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.out(torch.tanh(self.lin(x)))}


class Record(Records):
    """Records micro-batches and updates; kills this process at its ``kill_batch``-th
    micro-batch (counted from 1 in this attempt) or after update ``kill_step``."""

    def __init__(self, log: Path, kill_batch: int, kill_step: int, sig: int, pause: float):
        super().__init__(log)
        self.kill_batch, self.kill_step, self.sig = kill_batch, kill_step, sig
        self.pause, self.batches = pause, 0
        self.kill_micro, self.window_step, self.in_window = (-1, -1), -1, 0

    def _signal(self) -> None:
        self.kill_step = self.kill_batch = -1  # once
        os.kill(os.getpid(), self.sig)
        if self.sig == signal.SIGKILL:
            time.sleep(30)

    def on_train_begin(self) -> None:
        state = self.trainer.state
        self._write({"begin": state.global_step, "epoch": state.epoch, "count": self.count})
        if self.kill_step == 0:
            self._signal()

    def on_batch_begin(self, batch: Any) -> None:
        self.batches += 1
        state = self.trainer.state
        ids = [int(i) for i in batch["idx"]]
        self._write({"batch": ids, "filler": state.is_filler, "step": state.global_step})
        self.in_window = self.in_window + 1 if state.global_step == self.window_step else 1
        self.window_step = state.global_step
        at = (state.global_step, self.in_window) == tuple(self.kill_micro)
        if self.batches == self.kill_batch or at:
            self._signal()

    def on_backward_begin(self, loss: Any) -> None:
        value = loss[0] / loss[1] if isinstance(loss, tuple) else loss
        self._write({"micro_loss": float(value), "step": self.trainer.state.global_step})

    def on_step_end(self) -> None:
        state = self.trainer.state
        self.count += 1
        ft = getattr(self.trainer.strategy, "torchft", None)
        groups = ft.manager.num_participants() if ft else 1
        lr = self.trainer.optimizer.param_groups[0]["lr"]
        self._write(
            {
                "step": state.global_step,
                "epoch": state.epoch,
                "groups": groups,
                "lr": lr,
                "loss": state.loss,
                "loss_step": state.loss_step,
                "lost": state.lost_samples,
                "count": self.count,
            }
        )
        if self.kill_step > 0 and state.global_step == self.kill_step:
            self._signal()
        time.sleep(self.pause)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--update-every", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--plain", type=int, default=0, help="one plain process for N groups")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--sched", action="store_true", help="StepLR(step_size=3, gamma=0.5)")
    p.add_argument("--adam", action="store_true")
    p.add_argument("--amp", default=None)
    p.add_argument("--dev", action="store_true")
    p.add_argument("--nan-sample", type=int, default=-1)
    p.add_argument("--early-stop", type=int, default=0, help="EarlyStopCallback patience")
    p.add_argument("--on-nonfinite", default="raise")
    p.add_argument("--metric-key", default="-loss")
    p.add_argument("--save-path", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--print-every", type=int, default=1000)
    p.add_argument("--min-replicas", type=int, default=None)
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--kill-group", type=int, default=-1, help="2: both")
    p.add_argument("--kill-rank", type=int, default=-1, help="-1: every rank of the group")
    p.add_argument("--kill-batch", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-micro", type=int, nargs=2, default=None, metavar=("STEP", "K"))
    p.add_argument("--how", default="KILL")
    p.add_argument("--pause", type=float, default=0.05)
    p.add_argument("--save-model", default=None)
    args = p.parse_args()
    group = int(os.environ.get("FASTDIST_REPLICA_GROUP", "0"))
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    name = f"group{group}.rank{rank}.attempt{attempt}"
    groups = (0, 1) if args.kill_group == 2 else (args.kill_group,)  # 2: both groups
    mine = attempt == 0 and group in groups and args.kill_rank in (-1, rank)
    kill_batch = args.kill_batch if mine else -1
    kill_step = args.kill_step if mine else -1
    sig = getattr(signal, f"SIG{args.how}")
    fastdist.set_seed(0)
    model = Model()
    record = Record(args.out / f"{name}.jsonl", kill_batch, kill_step, sig, args.pause)
    if mine and args.kill_micro:
        record.kill_micro = tuple(args.kill_micro)
    callbacks: list[Callback] = [record]
    params = model.parameters()
    optimizer = (
        torch.optim.AdamW(params, lr=0.02) if args.adam else torch.optim.SGD(params, lr=0.05)
    )
    if args.sched:
        sched = torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)
        callbacks.append(LRSchedulerCallback(sched))
    if args.early_stop:
        from fastdist.callbacks import EarlyStopCallback

        callbacks.append(EarlyStopCallback(patience=args.early_stop))
    ft: dict[str, Any] = {"fault_tolerant": not args.plain}
    if args.min_replicas is not None:
        ft["min_replicas"] = args.min_replicas
    kwargs: dict[str, Any] = {}
    if args.dev:
        from fastdist import LossMetric

        kwargs.update(
            dev_data=Items(16), metrics=LossMetric(mse, target="y"), metric_key=args.metric_key
        )
        kwargs.update(validate_every=4)
    trainer = DistTrainer(
        train_data=Items(args.samples, args.nan_sample),
        model=model,
        loss=mse,
        optimizer=optimizer,
        strategy=(FSDP if args.fsdp else DDP)(**ft),
        callbacks_all=callbacks,
        batch_size_per_gpu=args.batch,
        n_epochs=args.epochs,
        update_every=args.update_every * max(args.plain, 1),
        save_path=args.save_path,
        checkpoint_every=args.ckpt_every,
        timeout=args.timeout,
        print_every=args.print_every,
        device="cpu",
        amp=args.amp,
        on_nonfinite=args.on_nonfinite,
        use_tqdm=False,
        **kwargs,
    )
    result = trainer.train()
    if args.save_model:
        trainer.save_model(args.save_model)
    full = (
        trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict") else None
    )
    sd = full if full is not None or args.fsdp else model.state_dict()
    end = {
        "epochs": record.epochs,
        "steps": result["steps"],
        "count": record.count,
        "lr": optimizer.param_groups[0]["lr"],
        "result": {k: v for k, v in result.items() if isinstance(v, int | float | str)},
        "best_eval": result.get("best_eval"),
        "params": {k: v.detach().flatten().tolist() for k, v in sd.items()} if sd else None,
    }
    (args.out / f"{name}.json").write_text(json.dumps(end, default=str))


if __name__ == "__main__":
    main()
    exit_now()
