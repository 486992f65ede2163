"""Faults a distributed job must turn into clear errors: ``fault_worker.py CASE OUT_DIR``.

Each case trains a tiny model on 2 ranks with ``timeout=TIMEOUT`` and injects one fault; rank
results (when a rank survives) go to ``OUT_DIR/rank<r>.json``. ``CASE`` may name several cases
that end well, comma-separated: they run in turn, each into ``OUT_DIR/<case>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler, TensorDataset
from workers.ending import exit_now

import fastdist
from fastdist import DistTrainer, get_rank
from fastdist.callbacks import Callback

TIMEOUT = 8.0


class Net(nn.Module):
    """A linear model that can raise or return NaN on one rank at one forward call."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.fault = fault
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.training and get_rank() == 1 and self.calls == 3:
            if self.fault in ("raise_forward", "raise_caught"):
                raise ValueError("boom in forward on purpose")
            if self.fault.startswith("nan"):
                return self.linear(x) * float("nan")
        return self.linear(x)


class AtStep(Callback):
    """Runs ``action(trainer)`` in on_step_end when global_step reaches ``step``."""

    def __init__(self, step: int, action) -> None:  # type: ignore[no-untyped-def]
        self.step = step
        self.action = action

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == self.step:
            self.action(self.trainer)


class FirstRanksLonger(Sampler[int]):
    """A user sampler that gives rank 0 more samples than rank 1."""

    def __init__(self, rank: int) -> None:
        self.indices = list(range(0, 64 if rank == 0 else 32))

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _edit_weight(trainer: DistTrainer) -> None:
    with torch.no_grad():
        trainer.model.linear.weight.add_(1.0)


def _poison_weight(trainer: DistTrainer) -> None:
    with torch.no_grad():
        trainer.model.linear.weight.fill_(float("nan"))


def _sleep_on_rank_1(trainer: DistTrainer) -> None:
    if get_rank() == 1:
        time.sleep(2 * TIMEOUT)  # past the timeout, by a margin for a loaded machine


def _ctrl_c(trainer: DistTrainer) -> None:
    """Ctrl-C in a terminal: SIGINT to every process of the job, each rank in its own code."""
    signal.raise_signal(signal.SIGINT)
    time.sleep(5)  # Python raises KeyboardInterrupt here


def _rank_1_dies_rank_0_busy(trainer: DistTrainer) -> None:
    """Rank 1 dies; rank 0 is busy far from any collective (a long evaluation, say)."""
    if get_rank() == 1:
        os._exit(1)
    time.sleep(60)


class SlowUpdatesRank1DiesInUpdate4(Callback):
    """Updates of 1.1 s (longer than a position's publishing interval); rank 1 dies in the
    middle of update 4, far from any sync point."""

    def on_step_end(self) -> None:
        time.sleep(1.1)

    def on_batch_begin(self, batch: object) -> None:
        if get_rank() == 1 and self.trainer.state.global_step == 3:
            os._exit(1)


class SlowStart(Callback):
    """A ``callbacks_master`` hook slower than the timeout when training begins (a logger
    opening its tracking store): the other ranks wait for it on the store."""

    def on_train_begin(self) -> None:
        time.sleep(TIMEOUT + 1)


def main(case: str, out: Path) -> None:
    fastdist.set_seed(0)
    if case.startswith("rzf"):
        fastdist.init_distributed(timeout=TIMEOUT)
        with fastdist.rank_zero_first(log_every=1.0):
            if get_rank() == 0:
                if case == "rzf_raise":
                    raise OSError("rank 0 could not build the cache")
                time.sleep(TIMEOUT + 3)  # longer than any collective may wait
        fastdist.barrier()
        if case == "rzf_raise":
            return

    x = torch.randn(64, 4)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = Net(case)
    callbacks_all, callbacks_master = [], []
    if case == "master_barrier":
        callbacks_master.append(AtStep(2, lambda t: fastdist.barrier()))
    if case == "master_all_reduce":
        callbacks_master.append(AtStep(2, lambda t: dist.all_reduce(torch.ones(1))))
    if case == "master_edit_weight":
        callbacks_master.append(AtStep(2, _edit_weight))
    if case == "timeout":
        callbacks_all.append(AtStep(2, _sleep_on_rank_1))
    if case == "dies_mid_run":
        callbacks_all.append(SlowUpdatesRank1DiesInUpdate4())
    if case == "peer_dies":
        callbacks_all.append(AtStep(2, _rank_1_dies_rank_0_busy))
    if case == "rzf_slow":  # and a master on_train_begin longer than the timeout
        callbacks_master.append(SlowStart())
    if case == "ctrl_c":
        callbacks_all.append(AtStep(3, _ctrl_c))
    if case == "inf_weight":  # after the last update (8): caught by the check at the end
        callbacks_all.append(AtStep(8, _poison_weight))
    trainer = DistTrainer(
        data,
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss=nn.MSELoss(),
        callbacks_all=callbacks_all,
        callbacks_master=callbacks_master,
        batch_size_per_gpu=4,
        n_epochs=1,
        # nan_raise: the NaN at update 3 is read at 4; dies_mid_run: no sync point near
        print_every={"nan_raise": 4, "dies_mid_run": 10}.get(case, 1),
        use_tqdm=False,
        timeout=None if case == "raise_caught" else TIMEOUT,  # torch's 30 minutes
        on_nonfinite="skip" if case == "nan_skip" else "raise",
        # inf_weight: the default comparison after the last update finds NaN alike on every rank
        check_sync_every={"master_edit_weight": 1, "nan_skip": 1, "inf_weight": None}.get(case, 0),
        sampler=FirstRanksLonger(get_rank()) if case == "uneven" else None,
        save_path=str(out / "save") if case in ("timeout", "ctrl_c") else None,  # hang dumps
        checkpoint_every=2 if case == "ctrl_c" else 0,
        # a DataLoader worker process of rank 0's own (spawned: a forked one may hang, see
        # fastdist.data.workers), which torchrun's SIGTERM kills while rank 0 reports
        **(
            {"num_workers": 1, "multiprocessing_context": "spawn"}
            if case == "raise_forward"
            else {}
        ),
    )
    if case == "raise_caught":  # the script catches rank 1's error and exits on its own
        try:
            trainer.train()
        except ValueError:
            sys.exit(3)
    result = trainer.train()
    record = dict(result, skipped=trainer.state.skipped_steps, ok=True)
    (out / f"rank{get_rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    cases, out = sys.argv[1].split(","), Path(sys.argv[2])
    for case in cases:
        if len(cases) > 1:
            (out / case).mkdir(exist_ok=True)
        main(case, out if len(cases) == 1 else out / case)
    exit_now()
