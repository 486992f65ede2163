"""One torchft replica group of a fault-tolerant run: ``ft_worker.py OUT_DIR [KILL_GROUP
KILL_STEP [--in-backward | --kill-healing]] [--epochs N] [--save-path DIR] [--check-sync N]
[--odd-model GROUP HOW] [--nudge STEP [--nudge-rank R]] [--print-every N]``, launched by
``python -m fastdist ft`` (or with the replica variables set); ``--plain``: one process of
plain DDP with update_every 2 instead; ``--fsdp``: ``FSDP(fault_tolerant=True)`` on a model of
two layers (launched with ``--procs-per-group 2``: every rank of group KILL_GROUP dies; rank
R > 0 writes ``group<G>.attempt<A>.rank<R>.json[l]``, with its own shards beside the whole
parameters).

A linear model on 64 samples (batch 2 per group, 3 epochs) with ``DDP(fault_tolerant=True)``.
Group KILL_GROUP SIGKILLs itself after update KILL_STEP (or its first later one, if it joined
late) on its first attempt (torchrun starts it again). The others, once training alone after
that update, wait before their last 10 updates (90 s at most, recorded as ``waited``) for the
killed group's restart (``OUT_DIR/restarted.<attempt>.*``; with ``--kill-healing`` for its
first restart 10 updates earlier), 4 s more once it is there (it asks for its first quorum
meanwhile, and heals at that update), and take 0.5 s per update from there while alone (else
0.05 s), so that they are still training when it comes back. Every
attempt appends its updates (step, epoch, participating groups, time) to
``OUT_DIR/group<G>.attempt<A>.jsonl`` as they commit, and writes ``...json`` at the end: per
epoch the lost samples and the updates skipped so far, the final parameters. With
``--kill-healing`` its second attempt dies too, while it loads a peer's state (heals).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset
from workers.ending import exit_now

import fastdist
from fastdist import DistTrainer
from fastdist.callbacks import Callback
from fastdist.distributed.dtensor import is_dtensor
from fastdist.strategies import DDP, FSDP


class Record(Callback):
    """Records each update; kills this process after update ``kill_step`` if asked."""

    def __init__(
        self, kill_step: int, killer: bool, log: Path, in_backward: bool, heal_killer: bool
    ) -> None:
        self.kill_step, self.killer, self.log = kill_step, killer, log
        self.in_backward, self.heal_killer = in_backward, heal_killer
        self.nudge = 0  # change the model after this update (a bug on one group)
        self.heal_killer_run = False  # the killed group dies again while it heals
        self.waited = 0.0  # seconds the last update's callback waited for a restart
        self.epochs: dict[int, dict[str, int]] = {}

    def on_step_end(self) -> None:
        state, strategy = self.trainer.state, self.trainer.strategy
        update = {"step": state.global_step, "epoch": state.epoch, "t": time.time()}
        update["waited"] = self.waited  # before this update, in the callback, not in training
        update["groups"] = strategy.torchft.manager.num_participants() if strategy.torchft else 1
        update["loss_step"] = state.loss_step  # the last log step whose loss was read
        with open(self.log, "a") as log:  # what a killed attempt did stays
            log.write(json.dumps(update) + "\n")
        if state.global_step == self.nudge:
            with torch.no_grad():
                next(self.trainer.strategy.model.parameters()).add_(1.0)
        if self.killer and state.global_step >= self.kill_step and not self.in_backward:
            os.kill(os.getpid(), signal.SIGKILL)
        # Alone near the end: stay for each restart of the killed group (the 10 updates after
        # each leave it time to join; killed while healing, its first restart needs a peer).
        final = 2 if self.heal_killer_run else 1
        left = (state.total_steps or 0) - state.global_step
        alone = update["groups"] == 1 and state.global_step > self.kill_step > 0
        alone = alone and left <= 10 * final
        start = time.monotonic()
        for restart in range(1, final + 1) if alone else ():
            if left <= 10 * (final - restart + 1):
                _wait_for(self.log.parent, f"restarted.{restart}.*")
                time.sleep(4)  # it asks for a quorum first: it heals at this update
        self.waited = time.monotonic() - start
        time.sleep(0.5 if alone else 0.05)

    def on_backward_begin(self, loss: object) -> None:
        """With ``in_backward``: die before update ``kill_step``'s all-reduce (the other
        groups' all-reduce fails, so none commits it)."""
        if (
            self.killer
            and self.in_backward
            and self.trainer.state.global_step >= self.kill_step - 1
        ):
            os.kill(os.getpid(), signal.SIGKILL)

    def state_dict(self) -> dict[str, int]:
        return {"kept": 1}  # a part of the state a healing group loads

    def load_state_dict(self, state: dict[str, int]) -> None:
        """With ``heal_killer``: die while loading the state of a peer (healing)."""
        if self.heal_killer:
            with open(self.log, "a") as log:
                log.write(json.dumps({"healing": True}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self) -> None:
        state = self.trainer.state  # skipped_steps: cumulative, uncommitted updates too
        self.epochs[state.epoch] = {"lost": state.lost_samples, "skipped": state.skipped_steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("kill", type=int, nargs="*", help="KILL_GROUP KILL_STEP")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-path", default=None)
    parser.add_argument("--plain", action="store_true", help="one process, DDP, update_every 2")
    parser.add_argument("--in-backward", action="store_true", help="kill before the all-reduce")
    parser.add_argument(
        "--kill-healing", action="store_true", help="kill KILL_GROUP again while it heals"
    )
    parser.add_argument("--check-sync", type=int, default=0, help="check_sync_every")
    parser.add_argument("--nudge", type=int, default=0, help="group 1 changes its model then")
    parser.add_argument("--nudge-rank", type=int, default=-1, help="on this rank only")
    parser.add_argument("--fsdp", action="store_true", help="FSDP(fault_tolerant=True)")
    parser.add_argument("--print-every", type=int, default=1000)
    parser.add_argument(
        "--odd-model",
        nargs=2,
        metavar=("GROUP", "HOW"),
        help="group GROUP's model differs from the others': 'wider' (shapes), 'renamed' or "
        "'frozen' (requires_grad=False)",
    )
    args = parser.parse_args()
    out = args.out
    group = int(os.environ.get("FASTDIST_REPLICA_GROUP", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    kill_group, kill_step = args.kill if args.kill and attempt == 0 else (-1, -1)
    fastdist.set_seed(0)
    x = torch.randn(64, 4)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    odd = args.odd_model[1] if args.odd_model and int(args.odd_model[0]) == group else ""
    model = _model("deeper" if args.fsdp else odd)
    name = f"group{group}.attempt{attempt}" + (f".rank{rank}" if rank else "")
    heal_killer = args.kill_healing and attempt == 1 and group == args.kill[0]
    log = out / f"{name}.jsonl"
    record = Record(kill_step, group == kill_group, log, args.in_backward, heal_killer)
    record.nudge = args.nudge if group == 1 and args.nudge_rank in (-1, rank) else 0
    record.heal_killer_run = args.kill_healing
    trainer = DistTrainer(
        train_data=data,
        model=model,
        loss=nn.MSELoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.02 if args.fsdp else 0.05, momentum=0.9),
        strategy=FSDP(fault_tolerant=True) if args.fsdp else DDP(fault_tolerant=not args.plain),
        callbacks_all=[record],
        batch_size_per_gpu=2,
        n_epochs=args.epochs,
        update_every=2 if args.plain else 1,  # the same samples per update as 2 groups
        save_path=args.save_path,
        timeout=30,
        check_sync_every=args.check_sync,
        print_every=args.print_every,
    )
    if attempt == 0:
        _all_ready(out)
    else:  # a survivor's last updates wait for this
        (out / f"restarted.{attempt}.{os.getpid()}").touch()
    start = time.time()
    result = trainer.train()
    (out / f"{name}.json").write_text(
        json.dumps(
            {
                "start": start,
                "epochs": record.epochs,
                "steps": result["steps"],
                "skipped": trainer.state.skipped_steps,
                "params": [_full(p).tolist() for p in model.parameters()],
                "shards": [
                    (p.to_local() if is_dtensor(p) else p).tolist() for p in model.parameters()
                ],
            }
        )
    )


def _all_ready(out: Path) -> None:
    """Wait until every process of every group has built its trainer, so that the groups'
    first quorum holds them all (one may start seconds after another here); ``FT_PROCESSES``:
    how many the groups have in all, where they differ in size."""
    (out / f"ready.{os.getpid()}").touch()
    groups = int(os.environ.get("FASTDIST_REPLICA_GROUPS", "1"))
    expected = groups * int(os.environ.get("WORLD_SIZE", "1"))
    _wait_for(out, "ready.*", int(os.environ.get("FT_PROCESSES", expected)))


def _wait_for(out: Path, pattern: str, count: int = 1, timeout: float = 90) -> None:
    """Wait (``timeout`` seconds at most) until ``count`` files in ``out`` match ``pattern``."""
    deadline = time.monotonic() + timeout
    while len(list(out.glob(pattern))) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (a collective of the group under FSDP)."""
    return param.full_tensor() if is_dtensor(param) else param


def _model(odd: str) -> nn.Module:
    """The model: a linear one, or with ``odd`` one that differs in shapes, names or frozen
    parameters, or one
    of two layers (``deeper``: FSDP shards each over the group, the last one unevenly)."""
    if odd == "deeper":
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    if odd == "wider":
        return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    if odd == "renamed":
        return nn.Sequential(nn.Identity(), nn.Linear(4, 1))
    if odd == "frozen":
        model = nn.Sequential(nn.Linear(4, 1), nn.Identity())
        model[0].bias.requires_grad_(False)
        return model
    return nn.Sequential(nn.Linear(4, 1), nn.Identity())


if __name__ == "__main__":
    main()
    exit_now()
