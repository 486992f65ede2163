"""Worker for tests/test_trainer.py: train tiny models with ``DistTrainer`` in a real world.

Usage (under torchrun or as a plain process)::

    trainer_worker.py CASE[,CASE...] OUT_DIR

Runs the named cases in order, one after another in the same process (group), and writes
``{"meta": ..., CASE: result, ...}`` as JSON to ``OUT_DIR/rank<R>.json``. Every case builds its
data and model with the helpers below, which tests/workers/bad_input_worker.py and
tests/test_callbacks.py share.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from workers.ending import exit_now

from fastdist import DDP, AccuracyMetric, Callback, CrossEntropyLoss, DistTrainer, Metric
from fastdist.callbacks import EarlyStopCallback, FitlogCallback
from fastdist.distributed import get_rank, get_world_size
from fastdist.logging import logger

DIM, HIDDEN, CLASSES = 4, 8, 3
BATCH = 8
HOOKS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_batch_begin",
    "on_loss_begin",
    "on_backward_begin",
    "on_backward_end",
    "on_step_end",
    "on_batch_end",
    "on_valid_begin",
    "on_valid_end",
    "on_epoch_end",
    "on_train_end",
    "on_exception",
)


# ----- shared helpers: tiny data, model and trainer -----


class ToyData(Dataset):
    """``n`` samples ``{"x", "target", "idx"}`` of a noisy linear teacher, made from ``seed``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=gen, dtype=torch.float64)
        teacher = torch.randn(DIM, CLASSES, generator=gen, dtype=torch.float64)
        noise = torch.randn(n, CLASSES, generator=gen, dtype=torch.float64)
        self.target = (self.x @ teacher + noise).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "target": self.target[i], "idx": i}


class ToyNet(nn.Module):
    """A float64 MLP ``DIM -> HIDDEN -> CLASSES`` (no dropout) returning logits."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.hidden = nn.Linear(DIM, HIDDEN, dtype=torch.float64)
        self.out = nn.Linear(HIDDEN, CLASSES, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


class NormNet(ToyNet):
    """``ToyNet`` with a batch norm after its hidden layer (the frozen run keeps it in eval
    mode: its running statistics fixed, its scale and shift trained)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.norm = nn.BatchNorm1d(HIDDEN, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.hidden(x))))


def flat_params(model: nn.Module) -> list[float]:
    """All parameters of ``model`` as one flat list."""
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


@contextlib.contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """The WARNING and ERROR lines of fastdist's logger while the block runs."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def make_trainer(
    n_train: int | Dataset, model: nn.Module | None = None, lr: float = 0.1, **kwargs: Any
) -> DistTrainer:
    """A quiet CPU ``DistTrainer`` on ``ToyData(n_train)`` (or the dataset ``n_train``) with
    SGD and cross entropy."""
    model = model if model is not None else ToyNet()
    options: dict[str, Any] = {
        "optimizer": torch.optim.SGD(model.parameters(), lr=lr),
        "loss": CrossEntropyLoss(),
        "batch_size_per_gpu": BATCH,
        "print_every": 10_000,
        "use_tqdm": False,
        "device": "cpu",
    }
    options.update(kwargs)
    data = ToyData(n_train) if isinstance(n_train, int) else n_train
    return DistTrainer(data, model, **options)


class Hook(Callback):
    """Calls ``fn(hook_name, trainer, *args)`` from every hook."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn


def _forward_hook(name: str) -> Callable[..., None]:
    def hook(self: Hook, *args: Any) -> None:
        self.fn(name, self.trainer, *args)

    hook.__name__ = name
    return hook


for _name in HOOKS:
    setattr(Hook, _name, _forward_hook(_name))


def on(hook: str, fn: Callable[..., None]) -> Hook:
    """A callback that calls ``fn(trainer, *args)`` from ``hook`` only."""
    return Hook(lambda name, trainer, *args: fn(trainer, *args) if name == hook else None)


# ----- cases -----


def case_equivalence(out: Path) -> dict[str, Any]:
    """Global batch 32 = 8 per rank x world x update_every; final weights per optimizer/size.

    Sizes not a multiple of the world size (323, 331, 289) leave shards one sample apart; with
    289 one rank has a batch fewer and runs a filler. ``sgd-203``: global batch 16 as one
    process x 16 or 2 x 8, update_every 1.
    """
    results: dict[str, Any] = {}
    runs = [("sgd", n) for n in (128, 56, 323, 289, 203)] + [("adamw", n) for n in (128, 56, 331)]
    for opt, n in runs:
        model = ToyNet(seed=1)
        init = flat_params(model)
        if opt == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        batching = {"update_every": 4 // get_world_size()}
        if n == 203:
            batching = {"batch_size_per_gpu": 16 // get_world_size(), "update_every": 1}
        trainer = make_trainer(n, model, optimizer=optimizer, n_epochs=2, **batching)
        result = trainer.train()
        results[f"{opt}-{n}"] = {
            "init": init,
            "final": flat_params(model),
            "steps": result["steps"],
        }
    results["frozen-289"] = frozen_norm_run()
    return results


def frozen_norm_run() -> dict[str, Any]:
    """289 samples (rank 1 of 2 runs a filler each epoch), a batch norm frozen in eval mode
    before ``train()``, an evaluation every 2 updates; callbacks put the whole model in eval
    mode in ``on_train_begin`` and in ``on_loss_begin``, and freeze the hidden layer in the
    ``on_loss_begin`` of epoch 1's last micro-batch (rank 1's filler). The batch norm stays
    frozen throughout and the hidden layer from epoch 2 on, on every rank; each micro-batch is
    announced in those modes; the model ends in the modes it came in. The hooks each update
    around an evaluation: ``on_batch_end`` before ``on_valid_begin``."""
    model = NormNet(seed=1)
    model.norm.eval()
    init, seen, hooks = flat_params(model), {}, []

    def loss_begin(trainer: DistTrainer, batch: Any, output: Any) -> None:
        state = trainer.state
        if state.epoch == 1 and state.global_step == 9 and state.is_update:  # update 10 of 10
            model.hidden.eval()
        else:  # (the whole model's eval mode is undone to the modes the epoch started in)
            trainer.model.eval()

    def batch_begin(trainer: DistTrainer, batch: Any) -> None:
        modes = (model.training, model.norm.training, model.hidden.training)
        seen.setdefault(trainer.state.epoch, set()).add(modes)

    trainer = make_trainer(
        289,
        model,
        lr=0.5,
        update_every=4 // get_world_size(),
        n_epochs=2,
        dev_data=ToyData(20, seed=1),
        metrics=AccuracyMetric(),
        validate_every=2,
        callbacks_all=[
            on("on_train_begin", lambda t: t.model.eval()),
            on("on_batch_begin", batch_begin),
            on("on_loss_begin", loss_begin),
            Hook(lambda name, t, *args: hooks.append(name)),
        ],
    )
    result = trainer.train()
    return {
        "init": init,
        "final": flat_params(model),
        "steps": result["steps"],
        "tracked": int(model.norm.num_batches_tracked),
        "modes_seen": {epoch: sorted(modes) for epoch, modes in seen.items()},
        "modes_after": [model.training, model.norm.training, model.hidden.training],
        "before_valid": sorted(
            {hooks[i - 1] for i, h in enumerate(hooks) if h == "on_valid_begin"}
        ),
    }


class CommCounter(Callback):
    """Counts DDP comm-hook calls and ``torch.distributed.all_reduce`` calls per micro-batch.

    The comm hook is registered in ``on_train_begin``, before the first forward. All-reduces
    issued by the hook itself are counted apart from all others.
    """

    def __init__(self) -> None:
        self.hook_calls = 0
        self.hook_all_reduces = 0
        self.other_all_reduces = 0
        self.in_hook = False
        self.has_ddp = False
        self.micro_batches: list[dict[str, Any]] = []
        self.epoch_end: list[int] = []
        self._mark: tuple[int, int] = (0, 0)
        self._epoch_end_mark: int | None = None

    @contextlib.contextmanager
    def counting_all_reduce(self) -> Iterator[None]:
        """Replace ``torch.distributed.all_reduce`` with a counting wrapper meanwhile."""
        real = dist.all_reduce

        def all_reduce(*args: Any, **kwargs: Any) -> Any:
            if self.in_hook:
                self.hook_all_reduces += 1
            else:
                self.other_all_reduces += 1
            return real(*args, **kwargs)

        dist.all_reduce = all_reduce
        try:
            yield
        finally:
            dist.all_reduce = real

    # No annotations: DDP checks them and would see strings (``from __future__ import ...``).
    def _hook(self, state, bucket):
        self.hook_calls += 1
        self.in_hook = True
        try:
            return allreduce_hook(None, bucket)  # type: ignore[arg-type]
        finally:
            self.in_hook = False

    def _close_epoch_end(self) -> None:
        if self._epoch_end_mark is not None:
            self.epoch_end.append(self.other_all_reduces - self._epoch_end_mark)
            self._epoch_end_mark = None

    def on_train_begin(self) -> None:
        ddp = self.trainer.strategy.module
        if isinstance(ddp, DistributedDataParallel):
            ddp.register_comm_hook(state=None, hook=self._hook)
            self.has_ddp = True

    def on_epoch_begin(self) -> None:
        self._close_epoch_end()

    def on_batch_begin(self, batch: Any) -> None:
        self._mark = (self.hook_calls, self.other_all_reduces)

    def on_batch_end(self) -> None:
        hooks, others = self._mark
        self.micro_batches.append(
            {
                "update": self.trainer.state.is_update,
                "hook_calls": self.hook_calls - hooks,
                "other_all_reduces": self.other_all_reduces - others,
            }
        )

    def on_epoch_end(self) -> None:
        self._epoch_end_mark = self.other_all_reduces

    def on_train_end(self) -> None:
        self._close_epoch_end()


def case_comm(out: Path) -> dict[str, Any]:
    """Count gradient and other all-reduces: update_every=4 (short last window), then 1."""
    results: dict[str, Any] = {}
    for name, n, update_every, n_epochs in (("accumulate", 96, 4, 2), ("plain", 32, 1, 1)):
        counter = CommCounter()
        trainer = make_trainer(
            n, update_every=update_every, n_epochs=n_epochs, callbacks_all=[counter]
        )
        with counter.counting_all_reduce():
            result = trainer.train()
        results[name] = {
            "steps": result["steps"],
            "has_ddp": counter.has_ddp,
            "hook_calls": counter.hook_calls,
            "hook_all_reduces": counter.hook_all_reduces,
            "other_all_reduces": counter.other_all_reduces,
            "micro_batches": counter.micro_batches,
            "epoch_end": counter.epoch_end,
        }
    return results


class SampleIds(Callback):
    """The sample ids this rank trains on per epoch; fillers (repeats weighted 0) left out."""

    def __init__(self) -> None:
        self.epochs: list[list[int]] = []

    def on_epoch_begin(self) -> None:
        self.epochs.append([])

    def on_batch_begin(self, batch: Any) -> None:
        if not self.trainer.state.is_filler:
            self.epochs[-1].extend(batch["idx"].tolist())


def case_coverage(out: Path) -> dict[str, Any]:
    """The sample ids each rank trains on, per epoch; 96 and 289 samples."""
    results: dict[str, Any] = {}
    for n in (96, 289):
        ids = SampleIds()
        make_trainer(n, update_every=2, n_epochs=3, callbacks_all=[ids]).train()
        results[str(n)] = ids.epochs
    return results


class CoverageMetric(Metric):
    """Reports how many samples were scored (``n``) and the sum of their ids (``idx_sum``)."""

    keys = ("n", "idx_sum")

    def reset(self) -> None:
        self.n = 0
        self.idx_sum = 0

    def update(self, output: Any, batch: Any) -> None:
        self.n += len(batch["idx"])
        self.idx_sum += int(batch["idx"].sum())

    def state(self) -> torch.Tensor:
        return torch.tensor([self.n, self.idx_sum], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        n, idx_sum = state.tolist()
        return {"n": n, "idx_sum": idx_sum}


def case_evaluate(out: Path) -> dict[str, Any]:
    """Evaluate 101 dev samples sharded over the ranks; also the accuracy one process gets."""
    dev = ToyData(101, seed=7)
    model = ToyNet(seed=3)
    results: dict[str, Any] = {}
    for dev_batch in (8, 7):
        trainer = make_trainer(
            16,
            model,
            dev_data=dev,
            metrics=[AccuracyMetric(), CoverageMetric()],
            dev_batch_size_per_gpu=dev_batch,
        )
        results[f"batch{dev_batch}"] = trainer.evaluate(dev)
        results[f"batch{dev_batch}-default-data"] = trainer.evaluate()
    with torch.no_grad():
        correct = int((model(dev.x).argmax(dim=1) == dev.target).sum())
    results["direct_acc"] = correct / len(dev)
    return results


class EchoCallback(Callback):
    """As fastNLP's own test callback: it overrides no hook, but notes every hook asked of it
    in ``__getattribute__``."""

    def __init__(self, tag: str, log: list[tuple[str, str]]) -> None:
        self.tag, self.log = tag, log

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_"):
            object.__getattribute__(self, "log").append(
                (name, object.__getattribute__(self, "tag"))
            )
        return super().__getattribute__(name)


class FailAtBegin(Callback):
    def on_train_begin(self) -> None:
        raise RuntimeError("fails on purpose, on every rank")


def case_hooks(out: Path) -> dict[str, Any]:
    """Which hooks ran, in which order, for two callbacks_all and one callbacks_master, each
    list ending with an EchoCallback; then which hooks echo in a run failing at its start."""
    log: list[tuple[str, str]] = []

    def recorder(tag: str) -> Hook:
        return Hook(lambda name, trainer, *args: log.append((name, tag)))

    make_trainer(
        48,
        update_every=2,
        n_epochs=2,
        dev_data=ToyData(20, seed=1),
        metrics=AccuracyMetric(),
        callbacks_all=[recorder("all-a"), recorder("all-b"), EchoCallback("all-echo", log)],
        callbacks_master=[recorder("master"), EchoCallback("master-echo", log)],
    ).train()
    failed: list[tuple[str, str]] = []
    trainer = make_trainer(
        16,
        callbacks_all=[EchoCallback("all-echo", failed), FailAtBegin()],
        callbacks_master=[EchoCallback("master-echo", failed)],
    )
    with contextlib.suppress(RuntimeError):
        trainer.train()
    return {"log": log, "failed": failed}


class StepLog(Callback):
    """Records where training ended."""

    def __init__(self) -> None:
        self.end: dict[str, Any] = {}
        self.micro_batches = 0

    def on_batch_end(self) -> None:
        self.micro_batches += 1

    def on_train_end(self) -> None:
        state = self.trainer.state
        self.end = {
            "epoch": state.epoch,
            "global_step": state.global_step,
            "total_steps": state.total_steps,
            "micro_batches": self.micro_batches,
        }


def case_stop(out: Path) -> dict[str, Any]:
    """Rank 0 alone requests a stop at update 5 (print_every=3); then EarlyStopCallback."""
    stop_at = 5

    def request(trainer: DistTrainer) -> None:
        if trainer.state.global_step == stop_at:
            trainer.request_stop()

    log = StepLog()
    result = make_trainer(
        64,
        n_epochs=3,
        print_every=3,
        dev_data=ToyData(20, seed=1),
        metrics=AccuracyMetric(),
        callbacks_all=[log],
        callbacks_master=[on("on_step_end", request)],
    ).train()
    results: dict[str, Any] = {"request": {"stop_at": stop_at, "result": result, "end": log.end}}

    # lr=0: the accuracy never improves after the first evaluation.
    log = StepLog()
    result = make_trainer(
        32,
        lr=0.0,
        n_epochs=10,
        dev_data=ToyData(20, seed=1),
        metrics=AccuracyMetric(),
        callbacks_all=[EarlyStopCallback(patience=2), log],
    ).train()
    results["early_stop"] = {"patience": 2, "result": result, "end": log.end}
    return results


class ScheduleMetric(Metric):
    """Reports ``score`` = the next value of ``scores`` at every evaluation (same on all ranks)."""

    keys = ("score",)

    def __init__(self, scores: list[float]) -> None:
        self.scores = list(scores)
        self.calls = 0
        super().__init__()

    def reset(self) -> None:
        self.n = 0

    def update(self, output: Any, batch: Any) -> None:
        self.n += len(batch["idx"])

    def state(self) -> torch.Tensor:
        return torch.tensor([self.n], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> dict[str, float]:
        self.calls += 1
        return {"score": self.scores[self.calls - 1]}


def _best_run(save_path: str | None, scores: list[float]) -> dict[str, Any]:
    """``scores`` over 3 epochs: epoch 2 is best and must be loaded at the end."""
    snapshots: dict[str, list[float]] = {}

    def snapshot_best(trainer: DistTrainer, result: Any, key: str, better: bool) -> None:
        if better:
            snapshots["best"] = flat_params(trainer.model)

    def snapshot_last(trainer: DistTrainer) -> None:
        snapshots["last"] = flat_params(trainer.model)  # before the best is loaded

    trainer = make_trainer(
        32,
        n_epochs=3,
        dev_data=ToyData(20, seed=1),
        metrics=ScheduleMetric(scores),
        save_path=save_path,
        load_best_model=True,
        callbacks_all=[on("on_valid_end", snapshot_best), on("on_train_end", snapshot_last)],
    )
    result = trainer.train()
    return {
        "result": result,
        "total_steps": trainer.state.total_steps,
        "best_params": snapshots["best"],
        "last_params": snapshots["last"],
        "final_params": flat_params(trainer.model),
        "best_model_path": trainer.best_model_path,
    }


def case_best(out: Path) -> dict[str, Any]:
    """The best model kept in a file under a per-rank save_path, then in memory (a NaN score
    first: never the best)."""
    return {
        "file": _best_run(str(out / f"save-rank{get_rank()}"), [0.2, 0.9, 0.5]),
        "memory": _best_run(None, [float("nan"), 0.9, 0.5]),
    }


def case_fitlog(out: Path) -> dict[str, Any]:
    """FitlogCallback in callbacks_master, logging every update; the reduced losses as seen."""
    losses: dict[int, float] = {}  # by the step they belong to (read an update late)
    evals: list[dict[str, float]] = []

    def record_loss(trainer: DistTrainer) -> None:
        state = trainer.state
        if state.loss is not None and state.loss_step is not None:
            losses[state.loss_step] = state.loss

    fitlog = FitlogCallback(log_dir=str(out / f"fitlog-rank{get_rank()}"))
    trainer = make_trainer(
        32,
        n_epochs=2,
        print_every=1,
        dev_data=ToyData(20, seed=1),
        metrics=AccuracyMetric(),
        callbacks_all=[
            on("on_batch_end", record_loss),
            on("on_valid_end", lambda trainer, result, *rest: evals.append(result)),
        ],
        callbacks_master=[fitlog],
    )
    trainer.train()
    test_result = trainer.evaluate(ToyData(12, seed=2))  # on every rank: a collective
    fitlog.log_test(test_result)  # only rank 0, where the callback ran, writes
    return {"losses": list(losses.items()), "evals": evals, "test": test_result}


class Numbers(torch.utils.data.IterableDataset):
    """A stream of the first ``n`` samples of ``ToyData(n)``."""

    def __init__(self, n: int) -> None:
        self.data = ToyData(n)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self.data[i] for i in range(len(self.data)))


def case_groups(out: Path) -> dict[str, Any]:
    """Open file descriptors after each of 4 trainers (a timeout group of their own, a stream
    agreeing on a gloo group of its own, local SGD's subgroup) is trained and dropped."""
    counts = []
    for _ in range(4):
        trainer = make_trainer(Numbers(32), timeout=60, strategy=DDP(average_every=1))
        trainer.train()
        del trainer
        gc.collect()
        counts.append(len(os.listdir("/proc/self/fd")))
    return {"fds": counts}


class RankZeroLearningRate(Callback):
    """A user's bug: the learning rate raised on rank 0 only, after update 1."""

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == 1 and get_rank() == 0:
            for group in self.trainer.optimizer.param_groups:
                group["lr"] *= 10


class ZeroAtEnd(Callback):
    """A master callback's own change after training (e.g. before an export): not a drift."""

    def on_train_end(self) -> None:
        with torch.no_grad():
            for p in self.trainer.model.parameters():
                p.zero_()


def case_replicas(out: Path) -> dict[str, Any]:
    """The default comparison of the replicas after the last update: a learning rate changed on
    rank 0 only (caught), the same with ``check_sync_every=0`` (off), a master callback zeroing
    rank 0's weights in ``on_train_end`` (after the comparison: no error)."""
    caught = ""
    try:
        make_trainer(32, n_epochs=2, callbacks_all=[RankZeroLearningRate()]).train()
    except RuntimeError as exc:
        caught = str(exc)
    off = make_trainer(32, n_epochs=2, callbacks_all=[RankZeroLearningRate()], check_sync_every=0)
    steps = off.train()["steps"]
    model = ToyNet()
    make_trainer(32, model, callbacks_master=[ZeroAtEnd()]).train()
    zeroed = all(not p.any() for p in model.parameters())
    return {"caught": caught, "off_steps": steps, "zeroed": zeroed}


CASES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "equivalence": case_equivalence,
    "comm": case_comm,
    "coverage": case_coverage,
    "evaluate": case_evaluate,
    "hooks": case_hooks,
    "stop": case_stop,
    "best": case_best,
    "fitlog": case_fitlog,
    "groups": case_groups,
    "replicas": case_replicas,
}


def refused(make: Any) -> str:
    """The error of a run that must be refused (``""``: none)."""
    try:
        make()
    except ValueError as exc:
        return str(exc)
    return ""


def write_json(out: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``out/rank<R>.json`` atomically."""
    path = out / f"rank{get_rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not set(argv[1].split(",")) <= CASES.keys():
        print(f"usage: {argv[0]} CASE[,CASE...] OUT_DIR; cases: {', '.join(CASES)}")
        return 2
    out = Path(argv[2])
    results: dict[str, Any] = {
        "meta": {
            "rank": get_rank(),
            "world_size": get_world_size(),
            "torchrun": "TORCHELASTIC_RUN_ID" in os.environ,
        }
    }
    for case in argv[1].split(","):
        results[case] = CASES[case](out)
    results["meta"]["group_at_end"] = dist.is_initialized()
    write_json(out, results)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
