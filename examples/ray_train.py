"""Train train_digits.py's digit classifier with Ray Train: an ordinary fastdist training
function, launched by ``ray.train.torch.TorchTrainer`` on CPU workers.

    pip install "fastdist[ray]"
    python examples/ray_train.py              # a local Ray cluster, 2 workers
    RAY_ADDRESS=head:6379 python examples/ray_train.py --workers 8 --use-gpu

Ray forms the process group and fastdist uses it. Every checkpoint goes to Ray with its metrics
(``result.checkpoint``, ``result.metrics``: epoch, step, loss, dev/acc, best/acc); workers that
Ray restarts after a failure (``--max-failures``) resume exactly from Ray's newest checkpoint,
on a fresh node too. Run it again with the same ``--storage`` and it resumes the same run (on
as many workers as ``--workers`` says, every remaining sample once).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer
from train_digits import Classifier, build_or_load_cached, log_best

import fastdist
from fastdist import AccuracyMetric, CrossEntropyLoss, DistTrainer, rank_zero_first
from fastdist.callbacks import GradientClipCallback, WarmupCallback


def train_fn(config: dict[str, Any]) -> None:
    """What every Ray worker runs: the same code as under torchrun."""
    fastdist.set_seed(42)
    with rank_zero_first():
        train_data, dev_data = build_or_load_cached(config["cache_dir"])
    model = Classifier()
    trainer = DistTrainer(
        train_data=train_data,
        dev_data=dev_data,
        model=model,
        loss=CrossEntropyLoss(pred="pred", target="target"),
        metrics=AccuracyMetric(pred="pred", target="target"),
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        callbacks_all=[WarmupCallback(warmup=0.1, schedule="linear"), GradientClipCallback(1.0)],
        batch_size_per_gpu=32,
        n_epochs=config["epochs"],
        use_tqdm=False,
        save_path=config["save_path"],  # its checkpoints also go to Ray's storage
    )
    log_best(trainer.train())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-failures", type=int, default=2)
    parser.add_argument("--storage", default="ray_results", help="Ray's storage (shared)")
    parser.add_argument("--cache-dir", default="cache")
    parser.add_argument("--save-path", default="save_ray")
    args = parser.parse_args()
    # The workers import train_digits from this directory, as this script does.
    ray.init(runtime_env={"working_dir": os.path.dirname(os.path.abspath(__file__))})
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={
            "epochs": args.epochs,
            "cache_dir": os.path.abspath(args.cache_dir),
            "save_path": os.path.abspath(args.save_path),
        },
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers, use_gpu=args.use_gpu),
        run_config=ray.train.RunConfig(
            name="digits",
            storage_path=os.path.abspath(args.storage),
            failure_config=ray.train.FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()
    checkpoint = result.checkpoint.path if result.checkpoint else None
    print(f"metrics {result.metrics}\ncheckpoint {checkpoint}")


if __name__ == "__main__":
    main()
