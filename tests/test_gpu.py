"""CUDA tests (marked ``gpu``): what users run on GPUs, in one process; skipped without CUDA.

They reuse tests/inprocess.py's tiny trainer with ``device="cuda"``. Run once on a GPU (one
H200, torch 2.11.0+cu130, 2026-11-27): five passed; the evaluate/predict test failed on its own
bug (it read a ``trainer.dev_data`` that does not exist), fixed since and checked on CPU only.
The host-sync count (issue 32) was written after that run and has not run on a GPU yet.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from inprocess import make_trainer, tiny_data

from fastdist.callbacks import Callback, GradientClipCallback

pytestmark = pytest.mark.gpu

LR, CLIP = 0.05, 0.01  # inprocess.make_trainer's SGD learning rate; a clip every update hits


def params(trainer: Any) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).cpu()


class InfOnce(Callback):
    """Makes update 2's gradient infinite (an fp16 overflow) before clipping sees it."""

    def on_backward_end(self) -> None:
        state = self.trainer.state
        if state.is_update and state.global_step == 1 and not state.skipped_steps:
            next(self.trainer.model.parameters()).grad.view(-1)[0] = float("inf")


class StepSizes(Callback):
    """The norm of every applied update's parameter change."""

    def __init__(self) -> None:
        self.before: torch.Tensor | None = None
        self.sizes: list[float] = []

    def on_backward_end(self) -> None:
        if self.trainer.state.is_update:
            self.before = params(self.trainer)

    def on_step_end(self) -> None:
        assert self.before is not None
        self.sizes.append(float((params(self.trainer) - self.before).norm()))


def test_fp16_skips_an_overflow_and_clips_after_unscaling() -> None:
    sizes = StepSizes()
    callbacks = [InfOnce(), GradientClipCallback(clip_value=CLIP), sizes]
    trainer = make_trainer(Callback(), device="cuda", amp="fp16", callbacks_all=callbacks)
    result = trainer.train()
    assert trainer.state.skipped_steps == 1 and trainer.precision.skipped_by_scaler == 1
    assert result["steps"] == 6 - 1  # 24 samples, batch 4: 6 updates, one skipped
    # Clipped on the true (unscaled) gradients: every step moves the weights by LR * CLIP.
    assert sizes.sizes and all(abs(s - LR * CLIP) < 1e-2 * LR * CLIP for s in sizes.sizes)
    assert torch.isfinite(params(trainer)).all()


def test_bf16_trains_close_to_fp32() -> None:
    torch.manual_seed(0)
    fp32 = make_trainer(Callback(), device="cuda", n_epochs=3)
    fp32.train()
    torch.manual_seed(0)
    bf16 = make_trainer(Callback(), device="cuda", n_epochs=3, amp="bf16")
    bf16.train()
    assert not torch.equal(params(fp32), params(bf16))
    assert torch.allclose(params(fp32), params(bf16), atol=0.05)


def test_compile_matches_eager() -> None:
    torch.manual_seed(0)
    eager = make_trainer(Callback(), device="cuda", n_epochs=2)
    eager.train()
    torch.manual_seed(0)
    compiled = make_trainer(Callback(), device="cuda", n_epochs=2, compile=True)
    compiled.train()
    assert torch.allclose(params(eager), params(compiled), atol=1e-5)


def test_fp16_resume_on_cuda_is_bit_exact(tmp_path: Any) -> None:
    options = {"device": "cuda", "amp": "fp16", "n_epochs": 2, "load_best_model": False}
    options |= {"checkpoint_every": 1, "keep_checkpoints": 20}
    torch.manual_seed(0)
    straight = make_trainer(Callback(), save_path=str(tmp_path / "a"), **options)
    straight.train()
    torch.manual_seed(0)
    resumed = make_trainer(Callback(), save_path=str(tmp_path / "b"), **options)
    resumed.train(resume=str(tmp_path / "a" / "checkpoints" / "step-00000005.pt"))
    assert torch.equal(params(straight), params(resumed))


def test_evaluate_and_predict_on_cuda_match_the_cpu() -> None:
    trainer = make_trainer(Callback(), device="cuda")
    data = tiny_data()  # make_trainer's dev_data
    x, y = data.tensors
    cpu_model = trainer.model.to("cpu")
    expected = cpu_model(x)["pred"]
    trainer.model.to("cuda")
    accuracy = float((expected.argmax(1) == y).float().mean())
    assert abs(trainer.evaluate()["acc"] - accuracy) < 1e-6
    preds = trainer.predict(data)
    assert preds is not None
    got = torch.tensor([p["pred"] for p in preds])
    assert torch.allclose(got, expected.detach(), atol=1e-5)


def test_batches_are_pinned_and_reach_the_gpu() -> None:
    seen: list[torch.device] = []

    class Where(Callback):
        def on_batch_begin(self, batch: Any) -> None:
            seen.append(batch[0].device)

    trainer = make_trainer(Where(), device="cuda")
    assert next(iter(trainer.data.loader))[0].is_pinned()
    trainer.train()
    assert seen and all(d.type == "cuda" for d in seen)


class SyncsPerBatch(Callback):
    """CUDA's synchronizing-operation warnings (``set_sync_debug_mode("warn")``), counted from
    each micro-batch's ``on_batch_begin`` to the next one's: the batch's own work and the read
    of the next batch, by whether the batch ended an update."""

    def __init__(self, caught: list[Any]) -> None:
        self.caught, self.mark = caught, 0
        self.is_update = False
        self.counts: dict[bool, list[int]] = {False: [], True: []}

    def syncs(self) -> int:
        return sum("synchroniz" in str(w.message) for w in self.caught)  # no other warning

    def on_batch_begin(self, batch: Any) -> None:
        if self.trainer.state.batch_idx > 0:  # the previous micro-batch's interval ends here
            self.counts[self.is_update].append(self.syncs() - self.mark)
        self.mark = self.syncs()

    def on_batch_end(self) -> None:
        self.is_update = self.trainer.state.is_update


def test_no_host_sync_per_micro_batch_or_update_between_log_steps() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        syncs = SyncsPerBatch(caught)
        trainer = make_trainer(syncs, device="cuda", update_every=2, print_every=1000)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(syncs.counts[False]) == 3 and len(syncs.counts[True]) == 2  # 6 micro-batches
    assert syncs.syncs(), "sync debug mode reported nothing over a whole run (evaluation syncs)"
    assert syncs.counts == {False: [0, 0, 0], True: [0, 0]}, [str(w.message) for w in caught]
