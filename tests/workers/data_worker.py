"""Worker for tests/test_data.py: token batches and mid-epoch resume in a real world.

Usage (under torchrun or as a plain process): ``data_worker.py OUT_DIR``. Writes
``OUT_DIR/rank<R>.json`` with every case's result.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from token_loss_worker import Sequences, Tagger, token_loss
from trainer_worker import SampleIds, flat_params, make_trainer, write_json
from workers.ending import exit_now

from fastdist import Callback, DistTrainer, get_world_size
from fastdist.data import TokenBatchSampler

N_SEQ, MAX_TOKENS = 203, 24


class IndexedSequences(Sequences):
    """Token-loss sequences of 1 to 9 tokens that also carry their index ``idx``."""

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        return {**super().__getitem__(i), "idx": i}


def sample_mean_loss(output: dict, batch: dict) -> torch.Tensor:
    """Mean over the samples of each sample's summed squared error (weights by samples)."""
    return ((output["pred"] - batch["target"]) ** 2 * batch["mask"]).sum(-1).mean()


class PaddedSizes(Callback):
    """Longest length x samples of every real micro-batch this rank trains on."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.sizes = lengths, []

    def on_batch_begin(self, batch: Any) -> None:
        if not self.trainer.state.is_filler:
            ids = batch["idx"].tolist()
            self.sizes.append(max(self.lengths[i] for i in ids) * len(ids))


def token_trainer(loss: Any, callbacks: list[Callback], **kwargs: Any) -> DistTrainer:
    """1 rank x update_every 4 or 2 ranks x 2 on token batches of ``MAX_TOKENS``, SGD."""
    data = IndexedSequences(N_SEQ)
    model = Tagger()
    return DistTrainer(
        data,
        model,
        torch.optim.SGD(model.parameters(), lr=0.02),
        loss=loss,
        batch_sampler=TokenBatchSampler(data.lengths, MAX_TOKENS, seed=5),
        update_every=4 // get_world_size(),
        n_epochs=2,
        use_tqdm=False,
        device="cpu",
        callbacks_all=callbacks,
        **kwargs,
    )


def case_token(out: Path) -> dict[str, Any]:
    """Final weights with a (sum, count) and a sample-mean loss; ids and padded sizes."""
    results: dict[str, Any] = {}
    for name, loss in (("sum-count", token_loss), ("sample-mean", sample_mean_loss)):
        torch.manual_seed(0)
        ids, padded = SampleIds(), PaddedSizes(IndexedSequences(N_SEQ).lengths)
        trainer = token_trainer(loss, [ids, padded])
        steps = trainer.train()["steps"]
        final = flat_params(trainer.model)
        results[name] = {"final": final, "steps": steps, "ids": ids.epochs, "padded": padded.sizes}
    return results


class StopAt(Callback):
    """Requests a stop after update ``step`` (agreed at the next sync); notes the first step."""

    def __init__(self, step: int) -> None:
        self.step, self.began_at = step, -1

    def on_train_begin(self) -> None:
        self.began_at = self.trainer.state.global_step

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == self.step:
            self.trainer.request_stop()


def _resume_pair(build: Any, save_path: Path, stop_at: int = 4) -> dict[str, Any]:
    """Straight run vs a run stopped mid-epoch (a stop asked for after update ``stop_at``)
    then resumed from its last checkpoint (step 3 for the default stop)."""
    straight = build([StopAt(-1)], None)  # the same callbacks in every run: checkpoints hold them
    straight.train()
    stopped = build([StopAt(stop_at)], save_path)
    stopped.train()
    resumed = build([StopAt(-1)], save_path)
    steps = resumed.train()["steps"]
    began_at = resumed.callbacks_all[-1].began_at
    return {
        "straight": flat_params(straight.model),
        "resumed": flat_params(resumed.model),
        "steps": steps,
        "stopped_at": stopped.state.global_step,
        "resumed_at": began_at,
    }


def case_resume(out: Path) -> dict[str, Any]:
    """Mid-epoch resume, map-style (323 samples) and token batches: bit-exact weights."""
    resume = {"print_every": 1, "checkpoint_every": 3}

    def build_map(callbacks: list[Callback], save_path: Path | None) -> DistTrainer:
        torch.manual_seed(0)
        return make_trainer(
            323,
            update_every=4 // get_world_size(),
            n_epochs=2,
            callbacks_all=callbacks,
            save_path=save_path,
            **resume,
        )

    def build_token(callbacks: list[Callback], save_path: Path | None) -> DistTrainer:
        torch.manual_seed(0)
        return token_trainer(token_loss, callbacks, save_path=save_path, **resume)

    return {
        "map": _resume_pair(build_map, out / f"map-{get_world_size()}"),
        "token": _resume_pair(build_token, out / f"token-{get_world_size()}"),
    }


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    write_json(out, {"token": case_token(out), "resume": case_resume(out)})
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
