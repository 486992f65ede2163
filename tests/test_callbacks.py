"""In-process unit tests: built-in callbacks, loss weights of micro-batches, metrics, losses.

Nothing here starts a process; a trainer built here runs as a one-process world.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import sys
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from workers.trainer_worker import ScheduleMetric, ToyData, ToyNet, make_trainer, on

from fastdist import AccuracyMetric, Callback, CrossEntropyLoss
from fastdist.callbacks import (
    CallbackList,
    EarlyStopCallback,
    GradientClipCallback,
    LRSchedulerCallback,
    WarmupCallback,
)
from fastdist.callbacks.callback import state_keys
from fastdist.data import TrainBatches, split_batches, window_weights
from fastdist.data.feed import make_forward, to_device
from fastdist.losses import as_loss_fn
from fastdist.trainer.precision import Precision

# ----- WarmupCallback -----


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_warmup_ramps_linearly(schedule: str) -> None:
    warmup = WarmupCallback(warmup=4, schedule=schedule)
    assert [warmup.factor(step, 20) for step in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]


def test_warmup_schedules_after_warmup() -> None:
    total, steps = 10, range(3, 11)
    constant = WarmupCallback(warmup=2, schedule="constant")
    linear = WarmupCallback(warmup=2, schedule="linear")
    cosine = WarmupCallback(warmup=2, schedule="cosine")
    assert [constant.factor(s, total) for s in steps] == [1.0] * 8
    assert [linear.factor(s, total) for s in steps] == pytest.approx(
        [1 - (s - 2) / 8 for s in steps]
    )
    assert [cosine.factor(s, total) for s in steps] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in steps]
    )
    # Decay ends at 0 and never goes below, even past the last update.
    assert linear.factor(total, total) == pytest.approx(0.0)
    assert cosine.factor(total, total) == pytest.approx(0.0)
    assert linear.factor(total + 3, total) == 0.0
    assert cosine.factor(total + 3, total) == pytest.approx(0.0)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_warmup_fraction_equals_steps(schedule: str) -> None:
    """warmup < 1 is a fraction of all updates: 0.2 of 10 is 2 updates."""
    fraction = WarmupCallback(warmup=0.2, schedule=schedule)
    steps = WarmupCallback(warmup=2, schedule=schedule)
    assert [fraction.factor(s, 10) for s in range(1, 11)] == pytest.approx(
        [steps.factor(s, 10) for s in range(1, 11)]
    )


def test_no_warmup() -> None:
    assert [WarmupCallback(0, "constant").factor(s, 4) for s in range(1, 5)] == [1.0] * 4
    linear = WarmupCallback(0.0, "linear")
    assert [linear.factor(s, 4) for s in range(1, 5)] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_warmup_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="schedule"):
        WarmupCallback(schedule="exponential")
    with pytest.raises(ValueError, match="warmup"):
        WarmupCallback(warmup=-0.1)


@pytest.mark.usefixtures("no_dist_env")
def test_warmup_sets_the_rate_of_every_update() -> None:
    """In a one-process trainer: update k uses base lr x factor(k, total_steps)."""
    rates: list[float] = []

    def record(trainer: Any) -> None:
        if trainer.state.is_update:  # the rate the coming optimizer step uses
            rates.append(trainer.optimizer.param_groups[0]["lr"])

    warmup = WarmupCallback(warmup=0.25, schedule="linear")
    trainer = make_trainer(
        32, lr=0.4, n_epochs=2, callbacks_all=[warmup, on("on_backward_end", record)]
    )
    assert trainer.train()["steps"] == trainer.state.total_steps == 8
    assert rates == pytest.approx([0.4 * warmup.factor(k, 8) for k in range(1, 9)])
    assert warmup.base_lrs == [0.4]


class BatchEnds(Callback):
    """Counts ``on_batch_end`` calls, in its saved state, and notes ``batches_in_epoch`` at
    each ``on_epoch_begin``; raises at ``on_batch_begin`` of the micro-batch after update
    ``crash_after`` (a crash once the checkpoint of it is written)."""

    def __init__(self, crash_after: int = 0) -> None:
        self.count, self.crash_after, self.begins = 0, crash_after, []

    def on_epoch_begin(self) -> None:
        self.begins.append(self.trainer.state.batches_in_epoch)

    def on_batch_begin(self, batch: Any) -> None:
        if self.crash_after and self.trainer.state.global_step == self.crash_after:
            raise RuntimeError("crash")

    def on_batch_end(self) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


@pytest.mark.usefixtures("no_dist_env")
def test_a_checkpoint_follows_its_updates_on_batch_end(tmp_path: Path) -> None:
    """A resumed callback counts every micro-batch's on_batch_end once: a checkpoint is written
    after its update's on_batch_end (it was written before it, and that call was lost: 15 of
    16 here). ``on_epoch_begin`` of the epoch resumed inside sees ``batches_in_epoch`` > 0, a
    new epoch's 0."""

    def run(name: str, counter: BatchEnds) -> None:
        make_trainer(
            64, update_every=2, n_epochs=2, callbacks_all=[counter],
            save_path=str(tmp_path / name), checkpoint_every=2,
        ).train(resume="auto")  # fmt: skip

    straight, crashed, resumed = BatchEnds(), BatchEnds(crash_after=3), BatchEnds()
    run("straight", straight)
    with pytest.raises(RuntimeError, match="crash"):
        run("crashed", crashed)
    run("crashed", resumed)  # from the checkpoint of update 2
    assert straight.count == resumed.count == 2 * 64 // 8
    assert (straight.begins, crashed.begins, resumed.begins) == ([0, 0], [0], [4, 0])


@pytest.mark.usefixtures("no_dist_env")
def test_a_stop_at_an_epochs_last_update_keeps_its_checkpoint(tmp_path: Path) -> None:
    """A stop agreed at the evaluation of an epoch's last update: that update's checkpoint
    (left to the epoch's end) is written, the epoch complete (an audit: none was, and every
    rerun trained that update again)."""
    stop = on(
        "on_valid_end", lambda t, *args: t.request_stop() if t.state.global_step == 4 else None
    )
    trainer = make_trainer(
        64, update_every=2, n_epochs=2, callbacks_all=[stop], save_path=str(tmp_path),
        dev_data=ToyData(8), metrics=AccuracyMetric(), validate_every=1, checkpoint_every=1,
    )  # fmt: skip
    assert trainer.train(resume=False)["steps"] == 4  # the last of epoch 1's 4 updates
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-00000003.pt",
        "step-00000004.pt",
    ]
    assert trainer.state.epoch_complete


@pytest.mark.usefixtures("no_dist_env")
def test_sys_exit_in_a_callback_is_reported_as_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    """``sys.exit()`` in a hook mid-training is reported like an exception (an audit: the rank
    left silently, exit code 0, and its peers reported it as dead, not where it left)."""
    seen: list[BaseException] = []
    leave = on("on_step_end", lambda t: sys.exit(0) if t.state.global_step == 2 else None)
    seen_by = on("on_exception", lambda t, exc: seen.append(exc))
    trainer = make_trainer(64, callbacks_all=[leave, seen_by])
    with caplog.at_level(logging.ERROR, logger="fastdist"), pytest.raises(SystemExit):
        trainer.train()
    assert "rank 0 raised SystemExit: 0\n  rank 0 (this rank): epoch 1, step 2" in caplog.text
    assert len(seen) == 1 and isinstance(seen[0], SystemExit)


@pytest.mark.usefixtures("no_dist_env")
def test_a_many_line_error_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """An error whose message spans lines (a DataLoader worker's carries the worker's
    traceback) is named by its first line in the failure report; its whole message ends the
    traceback logged with it (an audit: the worker's traceback was logged twice)."""

    def fail_at(trainer: Any) -> None:
        raise ValueError("first line\n" + "second" + " line")  # the source line: not counted

    fail = on("on_step_end", fail_at)
    with caplog.at_level(logging.ERROR, logger="fastdist"), pytest.raises(ValueError):
        make_trainer(16, callbacks_all=[fail]).train()
    assert "rank 0 raised ValueError: first line\n  rank 0 (this rank): epoch 1" in caplog.text
    assert caplog.text.count("second line") == 1


@pytest.mark.usefixtures("no_dist_env")
def test_a_best_written_after_the_resumed_checkpoint_is_kept_and_not_called_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The run stopped after its epoch-2 best was written over the best-model file, before
    the epoch-2 checkpoint; resumed from epoch 1's with fewer epochs, it writes no best: the
    file is not called damaged (an audit: every rank raised "damaged, replaced or removed"),
    is left as the stopped run wrote it, and the model keeps its last weights. Resumed for
    more epochs, its next best goes to a new file."""

    def stop(trainer: Any) -> None:
        if trainer.state.epoch == 2:  # after epoch 2's evaluation, before its checkpoint
            raise RuntimeError("stopped")

    def run(n_epochs: int, scores: list[float], **options: Any) -> Any:
        trainer = make_trainer(
            32, n_epochs=n_epochs, save_path=str(tmp_path), dev_data=ToyData(8),
            metrics=ScheduleMetric(scores), **options,
        )  # fmt: skip
        return trainer, trainer.train(resume="auto")

    with pytest.raises(RuntimeError, match="stopped"):
        run(3, [0.5, 0.9, 0.1], callbacks_master=[on("on_epoch_end", stop)])
    (stopped,) = tmp_path.glob("best_*")
    written = stopped.read_bytes()
    with caplog.at_level(logging.WARNING, logger="fastdist"):
        trainer, result = run(1, [])  # epoch 1 was complete: nothing to train
    assert result["best_epoch"] == 1 and stopped.read_bytes() == written
    assert f"the best model {stopped} is not as the checkpoint this run resumes" in caplog.text
    assert "the best model of epoch 1 step 4 is not on disk" in caplog.text
    _, result = run(3, [0.7, 0.2])  # epoch 2's best (0.7) beats epoch 1's (0.5)
    assert result["best_epoch"] == 2 and stopped.read_bytes() == written
    assert len(list(tmp_path.glob("best_*"))) == 2


@pytest.mark.usefixtures("no_dist_env")
def test_a_copied_or_moved_save_path_resumes_with_its_own_best_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``save_path`` copied, then resumed: its next best is written into the copy's own
    file, the original's is left as it was (an audit: the resumed run rewrote the original's).
    Moved, then resumed: the best model in it is loaded (an audit: it was looked for where
    it had been, called changed, and the model kept its last weights)."""

    def run(save: Path, n_epochs: int, scores: list[float]) -> Any:
        return make_trainer(
            32, n_epochs=n_epochs, save_path=str(save), dev_data=ToyData(8),
            metrics=ScheduleMetric(scores),
        ).train(resume="auto")  # fmt: skip

    first, copy, moved = tmp_path / "first", tmp_path / "copy", tmp_path / "moved"
    assert run(first, 1, [0.5])["best_epoch"] == 1
    (original,) = first.glob("best_*")
    written = original.read_bytes()
    shutil.copytree(first, copy)
    with caplog.at_level(logging.WARNING, logger="fastdist"):
        assert run(copy, 2, [0.9])["best_epoch"] == 2  # resumed after epoch 1: a new best
    assert original.read_bytes() == written
    (own,) = copy.glob("best_*")
    assert own.name == original.name and own.read_bytes() != written
    first.rename(moved)
    with caplog.at_level(logging.INFO, logger="fastdist"):
        assert run(moved, 1, [])["best_epoch"] == 1  # nothing left to train: the best loaded
    assert "loaded the best model of epoch 1 step 4" in caplog.text
    assert "not as the checkpoint" not in caplog.text and "not on disk" not in caplog.text


@pytest.mark.usefixtures("no_dist_env")
def test_a_start_removes_what_killed_best_model_writes_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A best-model write killed before its rename leaves its temp (full size) and, if it was
    the run's first, the name it claimed (a file of 0 bytes, or an empty folder for "hf"):
    the next start in that ``save_path`` removes each temp named for a best model of its model
    and metric, and such a name if still empty, and nothing else (audits: each kill left
    another pair, the empty file looking like a best model; then a start removed a user's
    empty files and a temp-like file named like no file of the run's)."""
    stamp = "2026-01-01-00-00-0"
    dead = [f"best_ToyNet_acc_{stamp}1.pt", f"best_ToyNet_acc_{stamp}2"]  # claimed, empty
    temps = [f".tmp-{'a' * 32}-{dead[0]}", f".tmp-{'b' * 32}-{dead[1]}"]  # a file, a folder
    later = f"best_ToyNet_acc_{stamp}3.pt"  # a best written whole, then a later write killed
    temps.append(f".tmp-{'c' * 32}-{later}")
    kept = [
        later,
        f"best_ToyNet_acc_{stamp}4.pt",  # empty, but no write of it was killed
        f"best_Other_acc_{stamp}5.pt",  # another model's
        f".tmp-{'d' * 32}-best_Mine.pt",  # named for no file of the run's
        f".tmp-{'e' * 32}-best_ToyNet_acc_{stamp}6.pt",  # nor here (no such file)
        "best_notes.txt",
    ]
    tmp_path.joinpath(dead[0]).touch()
    tmp_path.joinpath(dead[1]).mkdir()
    tmp_path.joinpath(temps[0]).write_bytes(b"x" * 1000)
    tmp_path.joinpath(temps[1]).mkdir()
    tmp_path.joinpath(temps[1], "model.safetensors").write_bytes(b"x" * 10)
    tmp_path.joinpath(temps[2]).write_bytes(b"y" * 100)
    tmp_path.joinpath(later).write_bytes(b"a best model")
    for name in kept[1:]:  # the user's: empty, but the temp-like ones
        tmp_path.joinpath(name).write_bytes(b"z" if name.startswith(".tmp-") else b"")
    with caplog.at_level(logging.INFO, logger="fastdist"):
        make_trainer(
            16, save_path=str(tmp_path), dev_data=ToyData(8), metrics=AccuracyMetric()
        ).train()
    names = {p.name for p in tmp_path.iterdir()}
    assert not names & {*dead, *temps} and set(kept) <= names
    assert tmp_path.joinpath(later).read_bytes() == b"a best model"
    assert "removed 3 temp(s) of best-model writes that were killed" in caplog.text
    removed = f"removed 2 empty best-model name(s) that killed writes claimed from {tmp_path}"
    assert f"{removed}: {dead[0]}, {dead[1]}" in caplog.text


@pytest.mark.usefixtures("no_dist_env")
@pytest.mark.parametrize("damage", ["cut", "flipped", "replaced"])
def test_a_damaged_best_model_file_is_named_when_it_is_loaded(damage: str, tmp_path: Path) -> None:
    """The best model's file cut short after its last write, bytes of it flipped in place, or
    replaced by another model's weights of the same names and shapes: ``load_best_model``
    raises an ``OSError`` naming it, on every rank alike (audits: torch's "[Errno 22] Invalid
    argument" on rank 0 alone, the others a lost peer; the flipped and the replaced weights
    loaded silently, a wrong model)."""
    changed = r" \(ValueError: its contents differ from what was written \(CRC-32\)\)"
    cause = {"cut": "", "flipped": changed, "replaced": changed}

    def damage_it(trainer: Any) -> None:
        if trainer.state.epoch == 2:  # after its evaluation, the last to write the best model
            (best,) = tmp_path.glob("best_*")
            data = bytearray(best.read_bytes())
            if damage == "cut":
                best.write_bytes(data[:100])
            elif damage == "flipped":
                middle = len(data) // 2
                data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
                best.write_bytes(data)
            else:
                torch.save(ToyNet(seed=7).state_dict(), best)

    trainer = make_trainer(
        64, n_epochs=2, save_path=str(tmp_path), dev_data=ToyData(8), metrics=AccuracyMetric(),
        callbacks_master=[on("on_epoch_end", damage_it)],
    )  # fmt: skip
    best = re.escape(str(tmp_path / "best_")) + r"\S+"
    message = rf"load_best_model: the best model {best} cannot be read{cause[damage]}"
    with pytest.raises(OSError, match=message):
        trainer.train()
    assert trainer.state.epoch_complete and trainer.state.epoch == 2  # trained, checkpointed


# ----- LRSchedulerCallback, GradientClipCallback, EarlyStopCallback, CallbackList -----


class CountingScheduler:
    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1


@pytest.mark.parametrize("interval", ["step", "epoch", "evaluation"])
def test_lr_scheduler_interval(interval: str) -> None:
    scheduler = CountingScheduler()
    callback = LRSchedulerCallback(scheduler, interval=interval)
    for _ in range(3):
        callback.on_step_end()
    callback.on_valid_end({"acc": 0.5}, "acc", True)
    callback.on_valid_end({"acc": 0.5}, "acc", False)
    callback.on_epoch_end()
    assert scheduler.steps == {"step": 3, "evaluation": 2, "epoch": 1}[interval]
    with pytest.raises(ValueError, match="interval"):
        LRSchedulerCallback(scheduler, interval="batch")
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    for not_a_scheduler in (object(), optimizer):  # accepted; failed (or did nothing) later
        with pytest.raises(TypeError, match="LRSchedulerCallback needs a learning-rate sched"):
            LRSchedulerCallback(not_a_scheduler)


def test_reduce_lr_on_plateau_steps_on_each_evaluation_score() -> None:
    """A ReduceLROnPlateau steps after every evaluation on the metric_key score: the learning
    rates after each are those of a scheduler stepped by hand on the same scores."""
    model = ToyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)  # too small to move accuracy
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "max", 0.5, patience=0)
    seen: list[tuple[float, float]] = []  # (score, learning rate after the scheduler's step)
    record = on("on_valid_end", lambda t, result, key, _: seen.append((result[key], lr(t))))
    callbacks = [LRSchedulerCallback(plateau), record]
    trainer = make_trainer(
        32, model, optimizer=optimizer, callbacks_all=callbacks, n_epochs=4,
        dev_data=ToyData(8), metrics=AccuracyMetric(),
    )  # fmt: skip
    trainer.train()
    by_hand = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1e-6)
    replay = torch.optim.lr_scheduler.ReduceLROnPlateau(by_hand, "max", 0.5, patience=0)
    expected = []
    for score, _ in seen:
        replay.step(score)
        expected.append(by_hand.param_groups[0]["lr"])
    assert len(seen) == 4 and [rate for _, rate in seen] == expected
    assert expected[-1] <= 1e-6 / 8  # constant scores: halved at evaluations 2, 3 and 4
    with pytest.raises(ValueError, match="a ReduceLROnPlateau steps on a score"):
        LRSchedulerCallback(plateau, interval="epoch")


def lr(trainer: Any) -> float:
    return float(trainer.optimizer.param_groups[0]["lr"])


def _model_with_grads(scale: float) -> nn.Linear:
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, scale)
    return model


def _flat_grad(params: Any) -> torch.Tensor:
    grads = [p.grad for p in params]
    assert all(g is not None for g in grads)
    return torch.cat([g.flatten() for g in grads if g is not None])


def _attach(callback: Callback, **trainer: Any) -> None:
    trainer.setdefault("precision", Precision(None, torch.device("cpu")))  # fp32: no unscaling
    trainer.setdefault("optimizer", None)
    trainer.setdefault("topology", SimpleNamespace(stage_group=None))  # no pipeline
    callback.trainer = SimpleNamespace(**trainer)  # type: ignore[assignment]


def test_gradient_clip_by_norm_only_on_updates() -> None:
    model = _model_with_grads(10.0)
    clip = GradientClipCallback(clip_value=1.0, clip_type="norm")
    state = SimpleNamespace(is_update=False)
    _attach(clip, model=model, state=state)
    clip.on_backward_end()  # inside a window: the gradients are partial, left alone
    assert torch.all(_flat_grad(model.parameters()) == 10.0)
    state.is_update = True
    clip.on_backward_end()
    norm = torch.linalg.vector_norm(_flat_grad(model.parameters()))
    assert norm.item() == pytest.approx(1.0, rel=1e-4)


def test_gradient_clip_by_value_of_given_parameters() -> None:
    model = _model_with_grads(-5.0)
    clip = GradientClipCallback(0.5, "value", parameters=[model.weight])
    _attach(clip, model=model, state=SimpleNamespace(is_update=True))
    clip.on_backward_end()
    assert torch.all(_flat_grad([model.weight]) == -0.5)
    assert torch.all(_flat_grad([model.bias]) == -5.0)


def test_gradient_clip_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="clip_type"):
        GradientClipCallback(clip_type="l1")
    with pytest.raises(ValueError, match="clip_value"):
        GradientClipCallback(clip_value=0)


def test_early_stop_counts_evaluations_without_improvement() -> None:
    requests: list[int] = []
    early = EarlyStopCallback(patience=2)
    _attach(early, request_stop=lambda: requests.append(len(requests)))
    for i, better in enumerate([True, False, True, False]):
        early.on_valid_end({"acc": 0.5}, "acc", better)
        assert not requests, f"stopped at evaluation {i}"
    early.on_valid_end({"acc": 0.5}, "acc", False)
    assert requests == [0]
    with pytest.raises(ValueError, match="patience"):
        EarlyStopCallback(patience=0)


class Recorder(Callback):
    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log = name, log

    def on_epoch_begin(self) -> None:
        self.log.append(("on_epoch_begin", self.name))

    def on_valid_end(self, eval_result: dict[str, float], metric_key: str, is_better: bool) -> None:
        self.log.append(("on_valid_end", self.name))


@pytest.mark.parametrize("is_master", [True, False])
def test_callback_list_runs_all_then_master(is_master: bool) -> None:
    log: list[tuple[str, str]] = []
    all_cbs = [Recorder("a", log), Recorder("b", log)]
    master = Recorder("m", log)
    callbacks = CallbackList(all_cbs, [master], is_master)
    trainer = object()
    callbacks.set_trainer(trainer)  # type: ignore[arg-type]
    callbacks.on_epoch_begin()
    callbacks.on_valid_end({"acc": 1.0}, "acc", True)
    names = ["a", "b", "m"] if is_master else ["a", "b"]
    assert log == [(hook, n) for hook in ("on_epoch_begin", "on_valid_end") for n in names]
    assert all(cb.trainer is trainer for cb in all_cbs)
    assert hasattr(master, "trainer") == is_master


class Holding(Callback):
    """A callback whose state is ``value``: what it returns, and what a resume gives back."""

    def __init__(self, value: Any) -> None:
        self.value: Any = value
        self.loaded: list[Any] = []

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.loaded.append(state)


def test_a_falsy_callback_state_is_kept_and_restored() -> None:
    """0, 0.0, [] and a zero tensor are states; only {} and None mean "nothing to keep" (a
    count down to 0 was left out of the checkpoint and restarted after a resume; a tensor of
    several elements raised "Boolean value of Tensor ... is ambiguous" at the checkpoint)."""
    values = [0, 0.0, [], torch.zeros(3), {}, None, {"n": 1}]
    saved = CallbackList([Holding(v) for v in values], [], True).state_dict()
    kept = ["Holding#0", "Holding#1", "Holding#2", "Holding#3", "Holding#6"]
    assert list(saved["all"]) == kept and saved["master"] == {}
    fresh = [Holding(None) for _ in values]
    CallbackList(fresh, [], True).load_state_dict(saved)
    assert [cb.loaded for cb in fresh[:3]] == [[0], [0.0], [[]]]
    assert torch.equal(fresh[3].loaded[0], torch.zeros(3))
    assert fresh[4].loaded == fresh[5].loaded == [] and fresh[6].loaded == [{"n": 1}]


def test_a_hook_set_on_the_object_is_called() -> None:
    """``cb.on_step_end = fn`` on a plain Callback (it was never called: only hooks its class
    overrides were)."""
    calls: list[int] = []
    cb = Callback()
    cb.on_step_end = lambda: calls.append(1)  # type: ignore[method-assign]
    callbacks = CallbackList([cb], [], True)
    callbacks.on_step_end()
    callbacks.on_step_end()
    assert calls == [1, 1]


# ----- window_weights -----


@pytest.mark.parametrize(
    ("n", "update_every", "drop_last", "expected"),
    [
        (32, 4, False, [0.25] * 4),
        (28, 2, False, [0.5, 0.5, 8 / 12, 4 / 12]),  # short last window and micro-batch
        (28, 2, True, [0.5, 0.5, 1.0]),  # the 4 left over are dropped
        (56, 4, False, [0.25] * 4 + [8 / 24] * 3),
        (20, 1, False, [1.0, 1.0, 1.0]),
        (5, 2, False, [1.0]),
        (5, 2, True, []),
    ],
)
def test_window_weights(n: int, update_every: int, drop_last: bool, expected: list[float]) -> None:
    sizes = [split_batches(n, 8, drop_last)]
    assert window_weights(sizes, 0, update_every) == pytest.approx(expected)


def test_window_weights_of_uneven_ranks() -> None:
    """Rank 1 has a batch fewer: its filler weighs 0, rank 0's lone batch 2 (DDP halves it)."""
    sizes = [[8, 8, 8], [8, 8]]
    assert window_weights(sizes, 0, 2) == [0.5, 0.5, 2.0]
    assert window_weights(sizes, 1, 2) == [0.5, 0.5, 0.0]


@pytest.mark.parametrize("n", range(1, 60, 3))
@pytest.mark.parametrize("update_every", [1, 2, 3, 5])
def test_window_weights_average_each_window(n: int, update_every: int) -> None:
    """Weighted micro-batch means of a window equal the mean over all its samples."""
    losses = torch.rand(n, dtype=torch.float64)
    weights = window_weights([split_batches(n, 8, drop_last=False)], 0, update_every)
    batches = losses.split(8)
    assert len(weights) == len(batches)
    span = 8 * update_every
    for start in range(0, len(batches), update_every):
        window = range(start, min(start + update_every, len(batches)))
        weighted = sum(weights[i] * batches[i].mean() for i in window)
        expected = losses[start * 8 : start * 8 + span].mean()
        assert weighted.item() == pytest.approx(expected.item(), abs=1e-12)


@pytest.mark.parametrize(("n", "update_every"), [(20, 3), (24, 4), (10, 1), (7, 5)])
def test_the_data_owns_the_update_windows(n: int, update_every: int) -> None:
    """The windows the loop steps after are the ones ``window_weights`` averages over."""
    data = TrainBatches(TensorDataset(torch.arange(n)), 2, None, None, False, 0, 0, 1, update_every)
    data.begin(1, 0, 0)
    micro = len(data.weights)
    ends = [done for done in range(1, micro + 1) if data.ends_window(done)]
    assert ends == [*range(update_every, micro, update_every), micro]
    assert data.n_updates(1) == len(ends)


# ----- batches: to_device, make_forward -----


def test_to_device_keeps_the_structure() -> None:
    pair = (torch.zeros(1), [torch.ones(1), "text"])
    batch: dict[str, Any] = {"x": torch.ones(2), "pair": pair, "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert moved.keys() == batch.keys() and moved["n"] == 3
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert moved["pair"][1][1] == "text"
    assert torch.equal(moved["x"], batch["x"])


Pair = namedtuple("Pair", ["x", "target"])


def test_to_device_keeps_namedtuple_batches() -> None:
    """torch's default collate turns namedtuple samples into a namedtuple batch."""
    batch = Pair(torch.ones(2, 3), torch.tensor([0, 1]))
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved, Pair)
    assert torch.equal(moved.x, batch.x) and torch.equal(moved.target, batch.target)


def test_to_device_returns_a_flat_batch_already_there_as_it_is() -> None:
    """No new container per micro-batch where nothing moves (CPU training); a batch with a
    tensor elsewhere, or an item that is not a tensor, is still a new container."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    pair, fields = (torch.ones(2), torch.zeros(2)), {"x": torch.ones(2)}
    assert to_device(pair, cpu) is pair and to_device(fields, cpu) is fields
    moved = to_device(pair, meta)
    assert isinstance(moved, tuple) and [t.device for t in moved] == [meta, meta]
    assert to_device(fields, meta)["x"].device == meta and pair[0].device == cpu
    mixed = [torch.ones(1), 3]
    assert to_device(mixed, cpu) is not mixed and to_device(mixed, cpu) == mixed


class TakesX(nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale


class TakesAll(nn.Module):
    def forward(self, **fields: Any) -> list[str]:
        return sorted(fields)


def test_make_forward_feeds_batches() -> None:
    x = torch.ones(2)
    forward = make_forward(TakesX())
    assert torch.equal(forward(TakesX(), {"x": x, "target": 1, "idx": 0}), x)
    assert torch.equal(forward(TakesX(), {"x": x, "scale": 2.0}), 2 * x)
    assert torch.equal(forward(TakesX(), (x, torch.zeros(2))), x)  # (input, target)
    assert torch.equal(forward(TakesX(), (x,)), x)
    assert torch.equal(forward(TakesX(), x), x)
    assert make_forward(TakesAll())(TakesAll(), {"x": 1, "target": 2}) == ["target", "x"]


# ----- metrics -----


def test_accuracy_of_logits_and_of_class_ids() -> None:
    target = torch.tensor([0, 1, 2, 1])
    logits = F.one_hot(torch.tensor([0, 1, 1, 0]), 3).double()
    for pred in (logits, logits.argmax(dim=1)):
        metric = AccuracyMetric()
        metric.update({"pred": pred}, {"target": target})
        assert metric.compute(metric.state()) == {"acc": 0.5}


def test_accuracy_ignores_padding_and_reads_named_fields() -> None:
    metric = AccuracyMetric(pred="logits", target="label", ignore_index=-1)
    pred = torch.tensor([[1, 2, 0], [2, 2, 2]])
    label = torch.tensor([[1, 0, -1], [2, -1, -1]])
    metric.update({"logits": pred}, {"label": label})
    assert metric.state().tolist() == [2.0, 3.0]
    assert metric.compute(metric.state()) == {"acc": 2 / 3}


def test_accuracy_of_shards_sums_to_the_whole() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(101, 4, generator=gen)
    target = torch.randint(0, 4, (101,), generator=gen)
    whole = AccuracyMetric()
    whole.update(logits, {"target": target})
    states = []
    for rank in range(3):  # the evaluator's shards: rank, rank + world, ...
        shard = AccuracyMetric()
        for start in range(rank * 8, 101, 24):  # batches of 8
            rows = torch.arange(start, min(start + 8, 101))
            shard.update(logits[rows], {"target": target[rows]})
        states.append(shard.state())
    assert torch.equal(sum(states), whole.state())  # type: ignore[arg-type]
    assert whole.compute(sum(states)) == whole.compute(whole.state())  # type: ignore[arg-type]


def test_accuracy_reset_and_empty() -> None:
    metric = AccuracyMetric()
    assert metric.compute(metric.state()) == {"acc": 0.0}
    metric.update(torch.tensor([1, 1]), {"target": torch.tensor([1, 1])})
    metric.reset()
    assert metric.state().tolist() == [0.0, 0.0]


# ----- losses -----


def test_cross_entropy_matches_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=gen)
    target = torch.randint(0, 4, (6,), generator=gen)
    loss = CrossEntropyLoss()({"pred": logits}, {"target": target})
    assert torch.allclose(loss, F.cross_entropy(logits, target))
    assert loss.dim() == 0
    smooth = CrossEntropyLoss(label_smoothing=0.1)(logits, (None, target))
    assert torch.allclose(smooth, F.cross_entropy(logits, target, label_smoothing=0.1))


def test_cross_entropy_of_sequences_skips_padding() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 3, generator=gen)
    target = torch.tensor([[0, 1, 2, -100, -100], [2, 2, -100, -100, -100]])
    loss = CrossEntropyLoss(pred="scores", target="tags")({"scores": logits}, {"tags": target})
    keep = target != -100
    assert torch.allclose(loss, F.cross_entropy(logits[keep], target[keep]))


def test_as_loss_fn() -> None:
    logits, target = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    output, batch = {"pred": logits, "loss": torch.tensor(2.5)}, {"target": target}
    assert as_loss_fn(None)(output, batch).item() == 2.5
    with pytest.raises(ValueError, match="loss"):
        as_loss_fn(None)(logits, batch)
    torch_loss = as_loss_fn(nn.CrossEntropyLoss())(output, batch)
    assert torch.allclose(torch_loss, F.cross_entropy(logits, target))
    fastdist_loss = CrossEntropyLoss()
    assert as_loss_fn(fastdist_loss) is fastdist_loss

    def custom(out: Any, b: Any) -> torch.Tensor:
        return out["pred"].sum()

    assert as_loss_fn(custom) is custom
    with pytest.raises(TypeError, match="loss must be"):
        as_loss_fn("cross_entropy")


# ----- resuming with other callbacks -----


class Debug(Callback):
    """A stateless callback, as one added for debugging."""

    def on_step_end(self) -> None:
        pass


def test_resume_keys_callback_states_so_other_callbacks_never_block_it(
    tmp_path: Path, log_lines: list[str]
) -> None:
    """Callback states are keyed by class: a resumed run with a stateless callback added and
    another removed continues, each stateful callback gets its own state back, and a removed
    stateful one is named in a warning."""
    first = [Debug(), WarmupCallback(warmup=2), EarlyStopCallback(patience=5)]
    make_trainer(24, save_path=str(tmp_path), n_epochs=1, callbacks_all=first).train()
    warmup = WarmupCallback(warmup=2)
    resumed = make_trainer(
        24, save_path=str(tmp_path), n_epochs=2, callbacks_all=[warmup, on("on_step_end", _noop)]
    )
    assert resumed.train()["steps"] == 6  # 24 samples, batch 8: 3 updates an epoch
    assert warmup.base_lrs == [0.1]  # restored, not read from the warmed optimizer
    lost = [line for line in log_lines if "does not have" in line]
    assert len(lost) == 1 and "callbacks_all['EarlyStopCallback#0']" in lost[0], log_lines
    assert "Debug" not in lost[0] and "WarmupCallback" not in lost[0]


def _noop(trainer: Any) -> None:
    pass


def test_callbacks_of_one_class_are_keyed_by_index_or_state_key() -> None:
    class Named(Callback):
        def __init__(self, key: str) -> None:
            self.key = key

        @property
        def state_key(self) -> str:
            return self.key

    keyed = state_keys([WarmupCallback(), Named("a"), WarmupCallback()], "callbacks_all")
    assert list(keyed) == ["WarmupCallback#0", "a", "WarmupCallback#1"]
    with pytest.raises(ValueError, match="two callbacks with state_key 'a'"):
        state_keys([Named("a"), Named("a")], "callbacks_master")
