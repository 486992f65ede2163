"""LossMetric, ClassifyFPreRecMetric and the torchmetrics adapter, in one process.

A world of several ranks is simulated by summing the ``state()`` of one metric object per
shard, which is what the evaluator's all-reduce does; tests/test_predict.py runs them on 2 real
ranks.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import precision_recall_fscore_support
from workers.trainer_worker import ToyData, ToyNet, make_trainer

from fastdist import AccuracyMetric, CrossEntropyLoss
from fastdist.metrics import ClassifyFPreRecMetric, LossMetric, Metric
from fastdist.metrics_torchmetrics import (
    TorchMetricsAdapter,
    as_fastdist_metric,
    is_torchmetrics_metric,
)

C = 4


def batches(n: int, batch: int, seed: int = 0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(output, batch)`` pairs of random logits ``(b, C)`` and targets."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, C, generator=gen, dtype=torch.float64)
    target = torch.randint(0, C, (n,), generator=gen)
    return [
        ({"pred": logits[i : i + batch]}, {"target": target[i : i + batch]})
        for i in range(0, n, batch)
    ]


def run(metric_factory: Any, pairs: Sequence[tuple[Any, Any]], world: int) -> dict[str, float]:
    """Shard ``pairs`` round-robin over ``world`` metric objects, sum states, compute once."""
    metrics = [metric_factory() for _ in range(world)]
    for i, (output, batch) in enumerate(pairs):
        metrics[i % world].update(output, batch)
    total = sum(metric.state() for metric in metrics)
    assert isinstance(total, torch.Tensor) and total.dtype == torch.float64 and total.dim() == 1
    return metrics[0].compute(total)


def flat(pairs: Sequence[tuple[Any, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.cat([output["pred"] for output, _ in pairs])
    target = torch.cat([batch["target"] for _, batch in pairs])
    return logits, target


# ----- LossMetric -----


@pytest.mark.parametrize("world", [1, 2, 3])
def test_loss_metric_is_the_mean_per_sample_loss(world: int) -> None:
    """Batch means weighted by batch size: exactly the mean over all samples, any sharding."""
    pairs = batches(23, 5)  # a short last batch of 3
    logits, target = flat(pairs)
    expected = F.cross_entropy(logits, target, reduction="sum").item() / 23
    result = run(lambda: LossMetric(CrossEntropyLoss()), pairs, world)
    assert result.keys() == {"loss"}
    assert math.isclose(result["loss"], expected, rel_tol=1e-12)


def test_loss_metric_accepts_torch_modules_callables_and_output_loss() -> None:
    pairs = batches(10, 4)
    logits, target = flat(pairs)
    expected = F.cross_entropy(logits, target).item()
    module = run(lambda: LossMetric(torch.nn.CrossEntropyLoss()), pairs, 2)["loss"]
    fn = run(lambda: LossMetric(lambda o, b: F.cross_entropy(o["pred"], b["target"])), pairs, 2)
    with_loss = [({"loss": F.cross_entropy(o["pred"], b["target"])}, b) for o, b in pairs]
    from_output = run(lambda: LossMetric(None), with_loss, 2)["loss"]
    for value in (module, fn["loss"], from_output):
        assert math.isclose(value, expected, rel_tol=1e-12)
    # Named fields for a torch module; the batch size from the first tensor without a target.
    named = [({"y_hat": o["pred"]}, {"y": b["target"]}) for o, b in pairs]
    got = run(lambda: LossMetric(torch.nn.CrossEntropyLoss(), pred="y_hat", target="y"), named, 1)
    assert math.isclose(got["loss"], expected, rel_tol=1e-12)


def test_loss_metric_without_a_loss_computes_the_trainers() -> None:
    """LossMetric() beside DistTrainer(loss=...) and a model whose output has no "loss": the
    trainer's loss, as LossMetric(that loss) computes it (it raised "loss=None needs the model
    to return a dict with a 'loss' entry" at the first evaluation, after an epoch of
    training)."""
    model, dev = ToyNet(), ToyData(8)
    trainer = make_trainer(16, model, dev_data=dev, metrics=[LossMetric()], n_epochs=1)
    with torch.no_grad():
        expected = F.cross_entropy(model(dev.x), dev.target).item()
    assert math.isclose(trainer.evaluate()["loss"], expected, rel_tol=1e-12)


def test_loss_metric_rejects_a_non_scalar_loss() -> None:
    metric = LossMetric(lambda o, b: torch.ones(3))
    output, batch = batches(3, 3)[0]
    with pytest.raises(ValueError, match="scalar"):
        metric.update(output, batch)
    assert math.isnan(LossMetric().compute(LossMetric().state())["loss"])


# ----- ClassifyFPreRecMetric -----


def sklearn_scores(
    pred: torch.Tensor, target: torch.Tensor, labels: list[int] | None = None
) -> dict[str, float]:
    if labels is None:  # the classes that occur, as fastNLP and sklearn's default do
        labels = sorted(set(pred.tolist()) | set(target.tolist()))
    result = {}
    for average, prefix in (("micro", ""), ("macro", "macro_")):
        pre, rec, f, _ = precision_recall_fscore_support(
            target, pred, labels=labels, average=average, zero_division=0
        )
        result.update({f"{prefix}pre": pre, f"{prefix}rec": rec, f"{prefix}f": f})
    return result


def assert_close(got: dict[str, float], expected: dict[str, float]) -> None:
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-12, abs_tol=1e-15), (key, got, expected)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fprerec_matches_sklearn(world: int) -> None:
    pairs = batches(57, 8)
    logits, target = flat(pairs)
    pred = logits.argmax(-1)
    result = run(lambda: ClassifyFPreRecMetric(num_classes=C), pairs, world)
    assert set(result) == {"f", "pre", "rec", "macro_f", "macro_pre", "macro_rec"}
    assert_close(result, sklearn_scores(pred, target))
    assert result["f"] == result["pre"] == result["rec"] == (pred == target).double().mean()


def test_fprerec_ignore_index_ignore_labels_and_per_class() -> None:
    """Class ids as pred, padding skipped, class 0 left out; a class that never occurs."""
    pred = torch.tensor([[1, 1, 0, 2], [2, 0, 1, 1]])
    target = torch.tensor([[1, 2, 0, -100], [2, 1, -100, 0]])
    pairs = [({"pred": pred[i : i + 1]}, {"target": target[i : i + 1]}) for i in range(2)]
    metric = lambda: ClassifyFPreRecMetric(num_classes=5, ignore_labels=[0], only_gross=False)  # noqa: E731
    result = run(metric, pairs, 2)
    keep = target != -100
    p, t = pred[keep], target[keep]
    assert_close(result, sklearn_scores(p, t, labels=[1, 2]))  # 3 and 4 never occur
    # class 1: TP 1; FP 2 (pred 1 for targets 2 and 0); FN 1 (target 1 predicted 0)
    assert result["pre-1"] == pytest.approx(1 / 3) and result["rec-1"] == 0.5
    assert result["f-1"] == pytest.approx(2 * (1 / 3) * 0.5 / (1 / 3 + 0.5))
    assert result["f-4"] == result["pre-4"] == result["rec-4"] == 0.0
    assert "f-0" not in result and set(metric().keys) == set(result)


def test_fprerec_beta() -> None:
    pairs = batches(40, 10, seed=3)
    logits, target = flat(pairs)
    pred = logits.argmax(-1)
    result = run(lambda: ClassifyFPreRecMetric(num_classes=C, beta=2.0, only_gross=False), pairs, 2)
    _, _, f2, _ = precision_recall_fscore_support(
        target, pred, beta=2.0, labels=list(range(C)), zero_division=0
    )
    for c in range(C):
        assert math.isclose(result[f"f-{c}"], f2[c], rel_tol=1e-12)


def test_fprerec_needs_num_classes_and_ids_in_range() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        ClassifyFPreRecMetric()
    with pytest.raises(ValueError, match="ignore_labels"):
        ClassifyFPreRecMetric(num_classes=2, ignore_labels=[2])
    metric = ClassifyFPreRecMetric(num_classes=2)
    metric.update({"pred": torch.tensor([0, 3])}, {"target": torch.tensor([0, 1])})
    assert len(metric.state()) == 3 * 2 + 1  # fixed length whatever the ids
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        metric.compute(metric.state())
    empty = ClassifyFPreRecMetric(num_classes=2)
    assert empty.compute(empty.state())["f"] == 0.0


# ----- torchmetrics -----


@pytest.fixture
def torchmetrics() -> Any:
    """The optional torchmetrics module; its tests are skipped without it."""
    return pytest.importorskip("torchmetrics")


def test_adapter_matches_fastdist_accuracy_and_resets(torchmetrics: Any) -> None:
    pairs = batches(30, 8)
    tm = TorchMetricsAdapter(
        torchmetrics.Accuracy(task="multiclass", num_classes=C, average="micro"), key="tm_acc"
    )
    acc = AccuracyMetric()
    for metric in (tm, acc):
        for output, batch in pairs:
            metric.update(output, batch)
    assert tm.keys == ("tm_acc",) and tm.state().numel() == 0
    expected = acc.compute(acc.state())["acc"]
    assert math.isclose(tm.compute(tm.state())["tm_acc"], expected, abs_tol=1e-6)
    tm.reset()
    tm.update(*pairs[0])
    first = pairs[0][0]["pred"].argmax(-1) == pairs[0][1]["target"]
    assert math.isclose(tm.compute(tm.state())["tm_acc"], first.double().mean(), abs_tol=1e-6)


def test_adapter_rejects_non_scalar_results_and_other_objects(torchmetrics: Any) -> None:
    per_class = TorchMetricsAdapter(
        torchmetrics.Accuracy(task="multiclass", num_classes=C, average=None), key="acc_c"
    )
    per_class.update(*batches(8, 8)[0])
    with pytest.raises(ValueError, match="not a scalar"):
        per_class.compute(per_class.state())
    with pytest.raises(TypeError, match="torchmetrics.Metric"):
        TorchMetricsAdapter(AccuracyMetric(), key="x")


def test_as_fastdist_metric(torchmetrics: Any) -> None:
    acc = AccuracyMetric()
    assert as_fastdist_metric(acc) is acc
    wrapped = as_fastdist_metric(torchmetrics.Accuracy(task="multiclass", num_classes=C))
    assert isinstance(wrapped, TorchMetricsAdapter) and isinstance(wrapped, Metric)
    assert wrapped.keys == ("multiclassaccuracy",)
    named = as_fastdist_metric(torchmetrics.Accuracy(task="binary"), key="bin")
    assert isinstance(named, TorchMetricsAdapter) and named.keys == ("bin",)
    assert is_torchmetrics_metric(named.metric) and not is_torchmetrics_metric(acc)
    with pytest.raises(TypeError, match="torchmetrics.Metric"):
        as_fastdist_metric(object())


@pytest.mark.slow
def test_fastdist_does_not_import_torchmetrics() -> None:
    code = (
        "import sys, fastdist, fastdist.metrics_torchmetrics, fastdist.evaluation.predict\n"
        "assert 'torchmetrics' not in sys.modules, 'imported torchmetrics'\n"
        "assert not fastdist.metrics_torchmetrics.is_torchmetrics_metric(1)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
