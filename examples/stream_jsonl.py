"""Train the digit classifier on a stream: a JSON-lines file read line by line, never loaded whole.

    torchrun --nproc-per-node=2 examples/stream_jsonl.py      # 2 processes (CPU: gloo)
    python examples/stream_jsonl.py                           # 1 process

Rank 0 writes scikit-learn's bundled digits (no download) as ``cache/digits-train.jsonl``, one
``{"x": [64 pixels], "target": digit}`` object per line, while the other ranks wait. Training
then streams the file: fastdist gives line ``i`` to reader ``i % readers`` (readers: every
DataLoader worker of every rank), the ranks agree on each update's batches, and an epoch ends
when the file does. The dataset saves its byte offset (``state_dict``/``load_state_dict``), so
a run stopped mid-epoch resumes at the line it stopped at; run the command again to see it
resume from ``save_stream/checkpoints`` (delete that folder for a fresh run).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset
from train_digits import Classifier, Digits, build_or_load_cached, log_best

import fastdist
from fastdist import AccuracyMetric, CrossEntropyLoss, DistTrainer, logger, rank_zero_first
from fastdist.callbacks import GradientClipCallback, WarmupCallback


class JsonLines(IterableDataset):
    """The samples of a JSON-lines file, in file order; resumable at a byte offset.

    ``state_dict()`` is the offset of the next line of the current pass (0 once a pass has
    ended); ``load_state_dict()`` makes the next pass start there.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in f:
                self.offset += len(line)
                record = json.loads(line)
                yield {
                    "x": torch.tensor(record["x"], dtype=torch.float32),
                    "target": torch.tensor(record["target"]),
                }
        self.offset = 0

    def state_dict(self) -> dict[str, int]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.offset = state["offset"]


def write_jsonl(train: Digits, cache_dir: str) -> str:
    """Write ``train`` as JSON lines once (atomically); return the file's path."""
    path = os.path.join(cache_dir, "digits-train.jsonl")
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            for x, target in zip(train.x.tolist(), train.target.tolist(), strict=True):
                f.write(json.dumps({"x": [round(v, 4) for v in x], "target": target}) + "\n")
        os.replace(path + ".tmp", path)
        logger.info("wrote %d digits to %s", len(train), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size-per-gpu", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--cache-dir", default="cache")
    parser.add_argument("--save-path", default="save_stream")
    args = parser.parse_args()

    fastdist.set_seed(42)
    with rank_zero_first():
        train_data, dev_data = build_or_load_cached(args.cache_dir)
        path = write_jsonl(train_data, args.cache_dir)
    model = Classifier()
    trainer = DistTrainer(
        train_data=JsonLines(path),
        dev_data=dev_data,
        model=model,
        loss=CrossEntropyLoss(pred="pred", target="target"),
        metrics=AccuracyMetric(pred="pred", target="target"),
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        # A stream's length is unknown: warm up for a number of updates, not a fraction.
        callbacks_all=[WarmupCallback(warmup=20), GradientClipCallback(1.0)],
        batch_size_per_gpu=args.batch_size_per_gpu,
        num_workers=args.num_workers,
        n_epochs=args.epochs,
        print_every=10,
        checkpoint_every=20,
        save_path=args.save_path,
    )
    log_best(trainer.train())


if __name__ == "__main__":
    main()
