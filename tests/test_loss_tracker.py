"""In-process unit tests of the loss bookkeeping: sums, counts, folding, locating a NaN."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fastdist.trainer import loss_tracker
from fastdist.trainer.loss_tracker import LossTracker


def loss(value: float) -> torch.Tensor:
    """A micro-batch's loss, as a model's output gives it: it requires grad."""
    return torch.tensor(value, requires_grad=True)


def _train(tracker: LossTracker, losses: list[float], update_every: int = 1) -> None:
    """Feed ``losses`` as micro-batches; every ``update_every`` of them close an update."""
    for i, value in enumerate(losses, start=1):
        tracker.add(loss(value))
        if i % update_every == 0:
            tracker.end_window(applied=True)


def test_pending_sums_the_applied_updates_only() -> None:
    tracker = LossTracker(torch.device("cpu"))
    tracker.reset(step=0)
    _train(tracker, [1.0, 2.0, 3.0, 4.0], update_every=2)
    tracker.add(loss(100.0))
    tracker.end_window(applied=False)  # a skipped update counts for nothing
    assert tracker.pending().tolist() == [10.0, 4.0]
    tracker.reset(step=2)
    assert tracker.pending().tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "windows",
    [
        [[(1.0, 4), (2.0, 4)], [(3.0, 4), (5.0, 4)]],  # alike: one sum per update's row
        [[(1.0, 4), (2.0, 3)], [], [(3.0, 1), (5.0, 4), (7.0, 2)]],  # sizes and windows differ
    ],
)
def test_each_update_sums_its_losses_times_their_samples(windows: list[list[Any]]) -> None:
    """What a log step reads, and the NaN search's per-update sums, whatever the windows."""
    tracker = LossTracker(torch.device("cpu"))
    tracker.reset(step=0)
    for window in windows:
        for value, samples in window:
            tracker.add(loss(value), samples=samples)
        tracker.end_window(applied=True)
    expected = [sum(value * samples for value, samples in window) for window in windows]
    tracker._store()
    assert tracker.buffer[: tracker.n_buffered].tolist() == expected
    count = sum(samples for window in windows for _, samples in window)
    assert tracker.pending().tolist() == [sum(expected), count]


def test_counted_losses_sum_their_counts() -> None:
    tracker = LossTracker(torch.device("cpu"))
    tracker.add((loss(6.0), torch.tensor(3)))
    tracker.add((loss(4.0), 2))
    tracker.end_window(applied=True)
    assert tracker.pending().tolist() == [10.0, 5.0]


def test_a_nonfinite_loss_is_located_exactly_or_within_the_folded_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loss_tracker, "BUFFER_SIZE", 4)
    losses = [1.0] * 7
    losses[2] = float("nan")  # update 13: folded with updates 11-14 once update 15 arrives
    tracker = LossTracker(torch.device("cpu"))
    tracker.reset(step=10)
    _train(tracker, losses[:4])
    assert tracker.first_nonfinite() == (13, "update 13")
    _train(tracker, losses[4:])
    assert tracker.first_nonfinite() == (11, "one of updates 11-14")
    assert torch.isnan(tracker.pending()[0])

    tracker.reset(step=17)
    losses = [1.0] * 7
    losses[5] = float("inf")  # update 23, in the buffer after the first fold
    _train(tracker, losses)
    assert tracker.first_nonfinite() == (23, "update 23")
    assert tracker.pending()[1] == 7


def test_taken_updates_are_read_apart_from_the_next_ones() -> None:
    """A log step takes its updates; the next ones are pending while it is read, and a NaN
    among the taken ones is still located (the other buffer fills meanwhile)."""
    tracker = LossTracker(torch.device("cpu"))
    tracker.reset(step=0)
    _train(tracker, [1.0, float("nan"), 3.0])
    taken = tracker.take(step=3)
    _train(tracker, [5.0, 7.0])
    assert torch.isnan(taken[0]) and taken[1] == 3
    assert tracker.pending().tolist() == [12.0, 2.0]
    assert tracker.first_nonfinite(taken=True) == (2, "update 2")
    assert tracker.first_nonfinite() is None
    assert tracker.take(step=5).tolist() == [12.0, 2.0]
    assert tracker.first_nonfinite(taken=True) is None
    assert tracker.pending().tolist() == [0.0, 0.0]


def test_a_loss_that_is_not_a_scalar_is_refused() -> None:
    tracker = LossTracker(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"loss must return a scalar tensor .* got \(4,\)"):
        tracker.add(torch.ones(4))


def test_a_pipeline_agrees_on_the_loss_kind_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a pipeline (``everywhere``) the first update's all-reduce agrees whether the loss
    is ``(sum, count)``; a mean loss then costs no collective, and a later pair is refused."""
    reduced: list[torch.Tensor] = []
    monkeypatch.setattr(loss_tracker, "all_reduce_sum", lambda t, group: reduced.append(t) or t)
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    grad = model.weight.grad.clone()
    tracker = LossTracker(torch.device("cpu"))
    for _ in range(3):
        tracker.add(loss(1.0), share=0.5, samples=4)
        tracker.normalize(model, 1, None, everywhere=True)
        tracker.end_window(applied=True)
    assert len(reduced) == 1 and tracker.agreed is False
    assert torch.equal(model.weight.grad, grad)  # a mean's gradients are already weighted
    tracker.add((loss(3.0), 2))
    with pytest.raises(ValueError, match="return one kind throughout"):
        tracker.normalize(model, 1, None, everywhere=True)
    counted = LossTracker(torch.device("cpu"))
    for _ in range(2):  # a (sum, count) loss: its count reduced every update
        counted.add((loss(3.0), 2))
        counted.normalize(model, 1, None, everywhere=True)
        counted.end_window(applied=True)
    assert len(reduced) == 3 and counted.agreed is True
    assert torch.allclose(model.weight.grad, grad / 4)  # divided by the count twice
