"""One replica group (or, with ``--plain``, one plain process) of tests/test_ft_rules.py.

``ft_rules_worker.py OUT [options]``, launched by ``python -m fastdist ft`` (or with the
replica variables set). A float64 linear model on ``--n`` samples of dict items
``{"x", "y", "idx"}`` (``idx`` names the sample). ``--plain``: one process with plain DDP and
``update_every`` times ``--groups`` (the reference a run of that many groups without failures
must equal, by the docs). Every attempt appends each micro-batch (its sample ids, filler or
not) and each update (step, epoch, participating groups, lr) to
``OUT/group<G>.attempt<A>.jsonl`` as it happens and writes ``...json`` at its end: per epoch
the lost samples, the result of ``train()``, the final parameters and a stateful callback's
count.
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
from torch.utils.data import Dataset, IterableDataset
from workers.ending import exit_now

import fastdist
from fastdist import DistTrainer
from fastdist.callbacks import Callback, GradientClipCallback
from fastdist.strategies import DDP


class Items(Dataset):
    """``n`` dict samples; sample i's ``len`` (its token count) is 1 + i % 5."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "idx": i, "len": 1 + i % 5}


class Stream(IterableDataset):
    """The same samples as :class:`Items`, as a stream."""

    def __init__(self, n: int) -> None:
        self.items = Items(n)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return (self.items[i] for i in range(len(self.items)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1).double()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.lin(x)}


def mse(output: dict[str, torch.Tensor], batch: dict[str, Any]) -> torch.Tensor:
    return ((output["pred"] - batch["y"]) ** 2).mean()


def token_loss(output: dict[str, torch.Tensor], batch: dict[str, Any]) -> tuple[Any, Any]:
    """A ``(sum, count)`` loss: sample i weighs ``len`` tokens."""
    tokens = batch["len"].to(torch.float64)
    per = ((output["pred"] - batch["y"]) ** 2).squeeze(1) * tokens
    return per.sum(), tokens.sum()


class Records(Callback):
    """Writes records to ``log`` (JSON lines); keeps a count of updates (a callback's state,
    healed from a peer) and each epoch's lost samples."""

    def __init__(self, log: Path) -> None:
        self.log, self.count = log, 0
        self.epochs: dict[int, int] = {}

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.log, "a") as log:
            log.write(json.dumps(record) + "\n")

    def on_epoch_end(self) -> None:
        self.epochs[self.trainer.state.epoch] = self.trainer.state.lost_samples

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


class Record(Records):
    """Records micro-batches and updates; kills this process when asked."""

    def __init__(self, log: Path, kill_step: int, how: str) -> None:
        super().__init__(log)
        self.kill_step, self.how = kill_step, how

    def on_train_begin(self) -> None:
        self._write({"begin": self.trainer.state.global_step, "count": self.count})
        if self.how == "begin" and self.kill_step >= 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_batch_begin(self, batch: Any) -> None:
        state = self.trainer.state
        ids = [int(i) for i in batch["idx"]]
        self._write({"batch": ids, "filler": state.is_filler, "step": state.global_step})

    def on_backward_begin(self, loss: Any) -> None:
        if self.how == "backward" and 0 <= self.kill_step <= self.trainer.state.global_step + 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self) -> None:
        state, strategy = self.trainer.state, self.trainer.strategy
        self.count += 1
        ft = getattr(strategy, "torchft", None)
        groups = ft.manager.num_participants() if ft else 1
        lr = self.trainer.optimizer.param_groups[0]["lr"]
        update = {"step": state.global_step, "epoch": state.epoch, "groups": groups, "lr": lr}
        update["t"], update["loss"] = time.time(), state.loss
        update["loss_step"] = state.loss_step  # the log step state.loss is of
        self._write(update)
        if self.kill_step >= 0 and state.global_step >= self.kill_step:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "term":
                os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.alone_pause if groups == 1 and ft else self.pause)

    pause, alone_pause = 0.05, 0.05


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--update-every", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--groups", type=int, default=2, help="with --plain: groups to equal")
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--token-loss", action="store_true")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--token-batches", type=int, default=0, help="TokenBatchSampler max_tokens")
    p.add_argument("--dev", action="store_true")
    p.add_argument("--sched", action="store_true", help="a StepLR scheduler callback")
    p.add_argument("--adam", action="store_true")
    p.add_argument("--save-path", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--ckpt-async", action="store_true")
    p.add_argument("--check-sync", type=int, default=0)
    p.add_argument("--print-every", type=int, default=1000)
    p.add_argument("--min-replicas", type=int, default=None)
    p.add_argument("--kill", nargs=3, metavar=("GROUP", "STEP", "HOW"), default=None)
    p.add_argument("--pause", type=float, default=0.05)
    p.add_argument("--alone-pause", type=float, default=0.05, help="pause of a group alone")
    p.add_argument("--start-delay", nargs=2, type=float, default=None, metavar=("GROUP", "S"))
    p.add_argument("--amp", default=None)
    p.add_argument("--save-model", default=None, help="trainer.save_model(path) at the end")
    args = p.parse_args()
    group = int(os.environ.get("FASTDIST_REPLICA_GROUP", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    name = f"group{group}.attempt{attempt}"
    kill_step, how = -1, ""
    if args.kill and attempt == 0 and int(args.kill[0]) == group:
        kill_step, how = int(args.kill[1]), args.kill[2]
    if args.start_delay and int(args.start_delay[0]) == group:
        time.sleep(args.start_delay[1])  # a group whose machine is slow to start
    fastdist.set_seed(0)
    model = Model()
    data: Any = Stream(args.samples) if args.stream else Items(args.samples)
    record = Record(args.out / f"{name}.jsonl", kill_step, how)
    record.pause, record.alone_pause = args.pause, args.alone_pause
    callbacks: list[Callback] = [record]
    if args.clip:
        callbacks.append(GradientClipCallback(clip_value=args.clip, clip_type="norm"))
    params = model.parameters()
    optimizer = (
        torch.optim.AdamW(params, lr=0.05) if args.adam else torch.optim.SGD(params, lr=0.05)
    )
    if args.sched:
        from fastdist.callbacks import LRSchedulerCallback

        callbacks.append(
            LRSchedulerCallback(torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5))
        )
    ft: dict[str, Any] = {"fault_tolerant": not args.plain}
    if args.min_replicas is not None:
        ft["min_replicas"] = args.min_replicas
    kwargs: dict[str, Any] = {}
    if args.token_batches:
        from fastdist.data import TokenBatchSampler

        lengths = [1 + i % 5 for i in range(args.samples)]
        kwargs["batch_sampler"] = TokenBatchSampler(lengths, args.token_batches, seed=0)
    if args.dev:
        from fastdist import LossMetric

        kwargs.update(dev_data=Items(16), metrics=LossMetric(mse, target="y"), metric_key="-loss")
    trainer = DistTrainer(
        train_data=data,
        model=model,
        loss=token_loss if args.token_loss else mse,
        optimizer=optimizer,
        strategy=DDP(**ft),
        callbacks_all=callbacks,
        batch_size_per_gpu=args.batch,
        n_epochs=args.epochs,
        update_every=args.update_every * (args.groups if args.plain else 1),
        save_path=args.save_path,
        checkpoint_every=args.ckpt_every,
        checkpoint_async=args.ckpt_async,
        timeout=30,
        check_sync_every=args.check_sync,
        print_every=args.print_every,
        device="cpu",
        amp=args.amp,
        use_tqdm=False,
        **kwargs,
    )
    result = trainer.train()
    if args.save_model:
        trainer.save_model(args.save_model)
    end = {
        "epochs": record.epochs,
        "steps": result["steps"],
        "skipped": trainer.state.skipped_steps,
        "count": record.count,
        "result": {k: v for k, v in result.items() if isinstance(v, int | float | str)},
        "best_eval": result.get("best_eval"),
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
    }
    (args.out / f"{name}.json").write_text(json.dumps(end, default=str))


if __name__ == "__main__":
    main()
    exit_now()
