"""Worker for tests/test_predict.py: ``fastdist.predict`` and the metrics in a real world.

Usage (under torchrun or as a plain process)::

    predict_worker.py CASE[,CASE...] OUT_DIR SHARED_DIR

Runs the named cases in order in one process (group) and writes ``{"meta": ..., CASE: result}``
as JSON to ``OUT_DIR/rank<R>.json``. Every prediction spills into ``SHARED_DIR`` (which the
test checks is empty afterwards). The ``crash`` case is different: the last rank's model raises
at its 2nd batch and nobody catches it, so the launch must fail; it writes no JSON.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from trainer_worker import ToyData, ToyNet, make_trainer, write_json
from workers.ending import exit_now

from fastdist import AccuracyMetric, CrossEntropyLoss
from fastdist.data.feed import make_forward
from fastdist.distributed import barrier, get_rank, get_world_size
from fastdist.evaluation import Evaluator, predict
from fastdist.metrics import ClassifyFPreRecMetric, LossMetric
from fastdist.metrics_torchmetrics import TorchMetricsAdapter

N = 103  # 52 + 51 samples on 2 ranks: uneven shards


class IdxNet(nn.Module):
    """ToyNet's logits plus the dataset index of every sample: ``{"pred", "idx"}``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.net = ToyNet(seed)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.net(x), "idx": idx}


class FailingNet(IdxNet):
    """Raises at its ``fail_at``-th forward (1-based) on rank ``fail_rank``."""

    def __init__(self, fail_rank: int, fail_at: int = 2) -> None:
        super().__init__()
        self.fail_rank, self.fail_at, self.calls = fail_rank, fail_at, 0

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if get_rank() == self.fail_rank and self.calls == self.fail_at:
            raise ValueError(f"boom on rank {get_rank()} at batch {self.calls}")
        return super().forward(x, idx)


def plain_loop(model: nn.Module, data: Dataset) -> list[Any]:
    """The reference: one sample at a time, in order, in this process."""
    model.eval()
    outputs = []
    with torch.no_grad():
        for i in range(len(data)):  # type: ignore[arg-type]
            sample = data[i]
            out = model(sample["x"][None], torch.tensor([sample["idx"]]))
            outputs.append({"pred": out["pred"][0].tolist(), "idx": int(out["idx"][0])})
    return outputs


def max_diff(got: list[Any], expected: list[Any]) -> float | None:
    """Largest difference of the logits; ``None`` unless the indices match exactly.

    A batch of one takes another matrix-product path than a batch of several, which may change
    the last bit of a float64 logit, so the plain loop is compared with a tolerance.
    """
    if [o["idx"] for o in got] != [o["idx"] for o in expected]:
        return None
    pairs = zip(got, expected, strict=True)
    return max(abs(a - b) for g, e in pairs for a, b in zip(g["pred"], e["pred"], strict=True))


def listing(shared: Path) -> list[str]:
    """What is in ``shared`` between two predictions, seen by every rank.

    The first barrier waits for rank 0 to finish merging; the second keeps rank 0 from
    creating the next prediction's directory while another rank still looks.
    """
    barrier()
    found = sorted(str(p.relative_to(shared)) for p in shared.rglob("*"))
    barrier()
    return found


def case_order(out: Path, shared: Path) -> dict[str, Any]:
    """The list on rank 0 for batch sizes 8 and 5; the plain loop; the model's mode after.

    The test compares the lists of both worlds exactly: the rows of a batch do not depend on
    which other rows it holds (batch 8 and batch 5 agree to the bit here too).
    """
    model = IdxNet(seed=3)
    model.train()
    results: dict[str, Any] = {}
    for batch in (8, 5):
        results[f"batch{batch}"] = predict(model, ToyData(N), batch, shared_dir=shared)
    results["training_after"] = model.training
    results["plain"] = plain_loop(model, ToyData(N))
    results["left"] = listing(shared)
    return results


def case_output_path(out: Path, shared: Path) -> dict[str, Any]:
    """output_path and writer: rank 0 writes each sample once, in order; both return None."""
    model = IdxNet(seed=3)
    path = out / f"pred-{get_world_size()}.jsonl"
    written: list[Any] = []
    returned = predict(model, ToyData(N), 8, output_path=path, shared_dir=shared)
    by_writer = predict(
        model, ToyData(N), 8, writer=lambda i, o: written.append([i, o]), shared_dir=shared
    )
    return {
        "path": str(path),
        "returned": [returned, by_writer],
        "written": written,
        "tmp_files": sorted(p.name for p in out.iterdir() if ".tmp" in p.name),
        "left": listing(shared),
    }


def case_sampler(out: Path, shared: Path) -> dict[str, Any]:
    """Training settings (seed, drop_last, batch, update_every, timeout group) don't matter."""
    settings: dict[str, dict[str, Any]] = {
        "default": {},
        "seed7-droplast": {"seed": 7, "drop_last": True},
        "batch5-update3": {"batch_size_per_gpu": 5, "update_every": 3},
        "timeout-group": {"timeout": 60, "dev_batch_size_per_gpu": 3},
    }
    results: dict[str, Any] = {}
    for name, kwargs in settings.items():
        model = IdxNet(seed=5)
        trainer = make_trainer(37, model, loss=CrossEntropyLoss(), **kwargs)
        if name == "default":
            trainer.train()
        outputs = trainer.predict(ToyData(N), shared_dir=shared)  # type: ignore[attr-defined]
        if outputs is None:  # not rank 0
            results[name] = None
            continue
        results[name] = {
            "idx": [o["idx"] for o in outputs],
            "plain_loop_diff": max_diff(outputs, plain_loop(model, ToyData(N))),
        }
    results["left"] = listing(shared)
    return results


def _caught(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def case_failure(out: Path, shared: Path) -> dict[str, Any]:
    """The last rank's model raises at its 2nd batch: every rank raises, nothing is left."""
    failing = FailingNet(fail_rank=get_world_size() - 1)
    error = _caught(lambda: predict(failing, ToyData(N), 8, shared_dir=shared))
    left = listing(shared)
    # The ranks are still in step: a following prediction works.
    again = predict(IdxNet(), ToyData(N), 8, shared_dir=shared)
    return {
        "error": error,
        "left": left,
        "again": None if again is None else len(again),
        "left_again": listing(shared),
    }


def _metrics() -> list[Any]:
    import torchmetrics  # optional: the test leaves this case out without it

    return [
        AccuracyMetric(),
        TorchMetricsAdapter(
            torchmetrics.Accuracy(task="multiclass", num_classes=3, average="micro"), "tm_acc"
        ),
        TorchMetricsAdapter(
            torchmetrics.F1Score(task="multiclass", num_classes=3, average="macro"), "tm_macro_f"
        ),
        ClassifyFPreRecMetric(num_classes=3),
        LossMetric(CrossEntropyLoss()),
    ]


def case_metrics(out: Path, shared: Path) -> dict[str, Any]:
    """101 dev samples (51 + 50): fastdist and torchmetrics metrics, twice (state resets)."""
    model = ToyNet(seed=2)
    evaluator = Evaluator(model, False, make_forward(model), _metrics(), torch.device("cpu"), 8)
    first, second = evaluator.evaluate(ToyData(101, seed=4)), evaluator.evaluate(ToyData(101, 4))
    only_tm = Evaluator(model, False, make_forward(model), _metrics()[1:3], torch.device("cpu"), 8)
    trainer = make_trainer(16, ToyNet(seed=2), dev_data=ToyData(101, seed=4), metrics=_metrics())
    # Every rank's predictions, for the test's own (scikit-learn) computation.
    preds = predict(model, ToyData(101, seed=4), 8, shared_dir=shared)
    return {
        "evaluator": first,
        "again": second,
        "only_torchmetrics": only_tm.evaluate(ToyData(101, seed=4)),
        "trainer": trainer.evaluate(),
        "argmax": None if preds is None else [max(range(3), key=p.__getitem__) for p in preds],
        "targets": ToyData(101, seed=4).target.tolist(),
    }


CASES: dict[str, Callable[[Path, Path], dict[str, Any]]] = {
    "order": case_order,
    "output_path": case_output_path,
    "sampler": case_sampler,
    "failure": case_failure,
    "metrics": case_metrics,
}


def crash(shared: Path) -> None:
    """Uncaught: the last rank raises at its 2nd batch; the launch must fail, not hang."""
    predict(FailingNet(fail_rank=get_world_size() - 1), ToyData(N), 8, shared_dir=shared)


def main(argv: list[str]) -> int:
    if len(argv) != 4 or not set(argv[1].split(",")) <= CASES.keys() | {"crash"}:
        print(f"usage: {argv[0]} CASE[,CASE...] OUT_DIR SHARED_DIR; cases: {', '.join(CASES)}")
        return 2
    out, shared = Path(argv[2]), Path(argv[3])
    if argv[1] == "crash":
        crash(shared)
        return 0
    results: dict[str, Any] = {"meta": {"rank": get_rank(), "world_size": get_world_size()}}
    for case in argv[1].split(","):
        results[case] = CASES[case](out, shared)
    results["meta"]["group"] = dist.is_initialized()
    write_json(out, results)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
