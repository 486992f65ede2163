"""Driver for tests/test_ray.py: one ``TorchTrainer.fit()`` of launcher_worker's training
function on the test session's Ray cluster.

Usage::

    ray_driver.py ADDRESS OUT_DIR NAME --workers N [--max-failures F] [--kill-at S]

The run is named ``NAME`` with its storage in ``OUT_DIR/storage`` (a second fit of the same
name restores it: Ray hands the workers its newest checkpoint). Writes
``OUT_DIR/<NAME>-<N>.json``: the error (``None`` if the fit succeeded), ``result.metrics``, the
files of ``result.checkpoint`` and the metrics of every reported checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import ray
import ray.train
from ray.train.torch import TorchTrainer
from workers.launcher_worker import train_fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("out", type=Path)
    parser.add_argument("name")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args()
    # The workers import the training function from tests/workers, as this process does; the
    # controller collects each report at its poll, every 2 s by default (one report at a time).
    env_vars = {name: os.environ[name] for name in ("PYTHONPATH", "OMP_NUM_THREADS")}
    env_vars["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    ray.init(address=args.address, runtime_env={"env_vars": env_vars})
    save_root = args.out / "save"
    save_root.mkdir(exist_ok=True)
    config = {
        "out": str(args.out),
        "save_root": str(save_root),
        "kill_at": args.kill_at,
        "drop_env": True,
    }
    trainer = TorchTrainer(
        train_fn,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
        run_config=ray.train.RunConfig(
            name=args.name,
            storage_path=str(args.out / "storage"),
            failure_config=ray.train.FailureConfig(max_failures=args.max_failures),
        ),
    )
    report: dict[str, object] = {"error": None}
    try:
        result = trainer.fit()
    except Exception as exc:  # the run failed for good (Ray raises TrainingFailedError)
        report["error"] = f"{type(exc).__name__}: {exc}"
    else:
        checkpoint = result.checkpoint
        report["metrics"] = result.metrics
        report["checkpoint_files"] = sorted(os.listdir(checkpoint.path)) if checkpoint else None
        report["reported"] = [metrics for _, metrics in result.best_checkpoints or []]
    path = args.out / f"{args.name}-{args.workers}.json"
    path.write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
