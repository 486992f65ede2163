"""Less communication: DDP's fp16 and PowerSGD hooks and post-local SGD against plain all-reduce.

    python benchmarks/communication.py [--nproc 2] [--epochs 15] [--average-every 4]

The driver launches ONE torchrun job (``OMP_NUM_THREADS=1`` per process); in it every option
trains the same MLP 64-256-10 from the same seed on scikit-learn's bundled digits (1497
train, 300 dev, the split of ``examples/train_digits.py``) with ``DistTrainer``, one after
another. For each it reports the all-reduce calls and bytes per optimizer update that left
the ranks during training (gradients or parameters), the final training loss and dev
accuracy (fastdist's sharded evaluation after training) and the training time.

Counting, with ``worker.py``'s counters: plain all-reduce goes through a DDP hook that counts
its bucket and then calls torch's default hook; the other options are torch's own hooks and
``average_parameters``, which call ``torch.distributed.all_reduce``, wrapped to count tensors
reduced over more than one rank (post-local SGD's per-rank subgroups carry nothing).
Counting runs from ``on_train_begin`` to ``on_train_end``; the loop makes no all-reduce of
its own in between (``print_every`` exceeds the updates, no dev data while training).
"""

from __future__ import annotations

import argparse
import json
import os

from common import child_env, run_job

WORKER_ENV = "FASTDIST_COMM_BENCH_WORKER"
RESULT_PREFIX = "COMM_BENCH_RESULT "
OPTIONS = ("plain", "fp16", "powersgd", "local_sgd")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--average-every", type=int, default=4, help="post-local SGD period")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the job")
    return parser.parse_args()


# ----------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """Every rank: train with each option in turn; rank 0 prints one JSON line."""
    import torch
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import TensorDataset
    from worker import COUNTER, counting_hook, install_all_reduce_counter

    from fastdist import DDP, AccuracyMetric, DistTrainer, LossMetric, get_rank
    from fastdist.callbacks import Callback

    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train = TensorDataset(x[order[300:]], y[order[300:]])
    dev = TensorDataset(x[order[:300]], y[order[:300]])

    install_all_reduce_counter()

    class Counting(Callback):
        """Snapshots the counters at on_train_begin and on_train_end; plain DDP gets the
        counting hook (torch's default all-reduce hook, counted)."""

        def __init__(self, plain: bool) -> None:
            self.plain = plain
            self.begin: dict[str, int] = {}
            self.end: dict[str, int] = {}

        def on_train_begin(self) -> None:
            ddp = self.trainer.strategy.module
            if self.plain and isinstance(ddp, DistributedDataParallel):
                ddp.register_comm_hook(None, counting_hook)
            self.begin = COUNTER.snapshot()

        def on_train_end(self) -> None:
            self.end = COUNTER.snapshot()

        def per_update(self, what: str, steps: int) -> float:
            """DDP buckets plus explicit all-reduces during training, per update."""
            kinds = (f"ddp_{what}", f"explicit_{what}")
            return sum(self.end[k] - self.begin[k] for k in kinds) / steps

    results = {}
    for option in OPTIONS:
        torch.manual_seed(1234)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        counting = Counting(plain=option == "plain")
        trainer = DistTrainer(
            train,
            model,
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            loss=nn.CrossEntropyLoss(),
            callbacks_all=[counting],
            batch_size_per_gpu=args.batch_size,
            n_epochs=args.epochs,
            print_every=10**9,
            metrics=[AccuracyMetric(), LossMetric(nn.CrossEntropyLoss())],
            use_tqdm=False,
            device="cpu",
            load_best_model=False,
            strategy=DDP(
                comm_hook=option if option in ("fp16", "powersgd") else None,
                average_every=args.average_every if option == "local_sgd" else 0,
            ),
        )
        out = trainer.train()
        steps = out["steps"]
        results[option] = {
            "calls_per_update": counting.per_update("calls", steps),
            "bytes_per_update": counting.per_update("bytes", steps),
            "train_loss": trainer.evaluate(train)["loss"],
            "dev_acc": trainer.evaluate(dev)["acc"],
            "seconds": out["seconds"],
            "updates": steps,
        }
    if get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(RESULT_PREFIX + json.dumps({"params": params, "results": results}), flush=True)


# ----------------------------------------------------------------------------- driver


def main() -> None:
    if WORKER_ENV in os.environ:
        worker(argparse.Namespace(**json.loads(os.environ[WORKER_ENV])))
        return
    args = parse_args()
    env = child_env({WORKER_ENV: json.dumps(vars(args))})
    r = run_job(__file__, args.nproc, env, RESULT_PREFIX, args.timeout)
    results = r["results"]
    plain = results["plain"]["bytes_per_update"]
    print(
        f"MLP 64-256-10 ({r['params']} parameters, {r['params'] * 4} bytes in fp32) on the "
        f"digits, {args.nproc} ranks (gloo), batch {args.batch_size} per rank, "
        f"{args.epochs} epochs, SGD lr 0.05 momentum 0.9; local SGD every {args.average_every}"
    )
    print(
        f"{'option':<11}{'calls/update':>13}{'bytes/update':>14}{'vs plain':>10}"
        f"{'train loss':>12}{'dev acc':>9}{'train s':>9}"
    )
    for option, res in results.items():
        print(
            f"{option:<11}{res['calls_per_update']:>13.2f}{res['bytes_per_update']:>14.0f}"
            f"{res['bytes_per_update'] / plain:>10.3f}{res['train_loss']:>12.4f}"
            f"{res['dev_acc']:>9.4f}{res['seconds']:>9.2f}"
        )


if __name__ == "__main__":
    main()
