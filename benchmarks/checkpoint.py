"""Cost of a fastdist checkpoint against one plain ``torch.save`` of the same payload; with
``--stall``, how long training waits per checkpoint, synchronous against ``checkpoint_async``.

    python benchmarks/checkpoint.py [--params 100e6] [--repeats 3] [--dir /tmp]
    python benchmarks/checkpoint.py --stall [--params 50e6] [--strategy ddp|fsdp] [--rounds 2]

The payload is what ``DistTrainer`` writes: the model's and SGD-with-momentum's state. fastdist
writes a temp file, reads its CRC-32 back from the page cache, fsyncs, renames and updates the
manifest; the target is about one serialisation's time, i.e. no extra copy of the tensors.

``--stall`` trains that model (bias-free linear layers of width 4096, MSE) at 2 ranks over
gloo on the CPU, one torchrun job, checkpointing every ``--every`` updates, once with
synchronous checkpoints and once with ``checkpoint_async=True`` per round (the order flips
every round). It reports, per mid-epoch checkpoint, the time from that update's
``on_batch_end`` to the next micro-batch's ``on_batch_begin`` (the check of the weights, the
checkpoint, then drawing the next batch; the same span of an update without a checkpoint is
reported too), the last one (epoch end, which ``train()`` waits for) and the whole
``train()``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import child_env, run_job  # noqa: E402
from fastdist import Callback, DistTrainer, get_rank  # noqa: E402
from fastdist.checkpoint.files import CheckpointDir  # noqa: E402

WIDTH, BATCH = 4096, 4
PREFIX = "CHECKPOINT-BENCH "


def wide_model(n_params: float) -> nn.Sequential:
    layers = max(1, round(n_params / (WIDTH * WIDTH)))
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


def payload(n_params: float) -> dict:
    model = wide_model(n_params)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the momentum buffers
    count = sum(p.numel() for p in model.parameters())
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "params": count}


class Stalls(Callback):
    """Seconds from an update's ``on_batch_end`` (after which the loop checkpoints) to the next
    micro-batch's ``on_batch_begin``, per update with a checkpoint due and per update without
    (the epoch's last has no next); when the epoch ended."""

    def __init__(self, every: int) -> None:
        self.every, self.start, self.due = every, 0.0, False
        self.checkpoint: list[float] = []
        self.other: list[float] = []
        self.epoch_end = 0.0

    def on_batch_end(self) -> None:
        if self.trainer.state.is_update:
            self.start = time.perf_counter()
            self.due = self.trainer.state.global_step % self.every == 0

    def on_batch_begin(self, batch: object) -> None:
        if self.start:
            (self.checkpoint if self.due else self.other).append(time.perf_counter() - self.start)
            self.start = 0.0

    def on_epoch_end(self) -> None:
        self.epoch_end = time.perf_counter()


def train_once(options: dict, asynchronous: bool, directory: str) -> dict:
    """One run of ``--stall`` in this torchrun job: its stalls and times."""
    torch.manual_seed(0)
    model = wide_model(options["params"])
    steps, every = options["steps"], options["every"]
    n = steps * BATCH * 2
    data = TensorDataset(torch.randn(n, WIDTH), torch.randn(n, WIDTH))
    stalls = Stalls(every)
    trainer = DistTrainer(
        data,
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
        loss=nn.MSELoss(),
        callbacks_all=[stalls],
        batch_size_per_gpu=BATCH,
        n_epochs=1,
        print_every=steps,
        use_tqdm=False,
        device="cpu",
        checkpoint_dir=directory,
        checkpoint_every=every,
        keep_checkpoints=1,
        checkpoint_async=asynchronous,
        strategy=options["strategy"],
        slow_rank_threshold=0,
    )
    start = time.perf_counter()
    trainer.train(resume=False)
    end = time.perf_counter()
    mid = stalls.checkpoint  # the epoch end's is measured apart: from on_epoch_end to the end
    return {"mid": mid, "other": stalls.other, "end": end - stalls.epoch_end, "train": end - start}


def stall_worker() -> None:
    """Under torchrun: the rounds of ``--stall``; rank 0 prints the JSON of every run."""
    options = json.loads(os.environ["CHECKPOINT_BENCH"])
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for round_ in range(options["rounds"]):
        order = ["sync", "async"] if round_ % 2 == 0 else ["async", "sync"]
        for mode in order:
            with tempfile.TemporaryDirectory(dir=options["dir"]) as tmp:
                directory = os.path.join(tmp, "checkpoints")
                runs[mode].append(train_once(options, mode == "async", directory))
    if get_rank() == 0:
        print(PREFIX + json.dumps(runs), flush=True)


def stall(args: argparse.Namespace) -> None:
    """``--stall``: launch the job, summarise what it measured."""
    layers = max(1, round(args.params / (WIDTH * WIDTH)))
    mib = layers * WIDTH * WIDTH * 4 / 2**20
    options = {
        "params": args.params,
        "strategy": args.strategy,
        "steps": args.steps,
        "every": args.every,
        "rounds": args.rounds,
        "dir": args.dir,
    }
    env = child_env({"CHECKPOINT_BENCH": json.dumps(options)})
    runs = run_job(os.path.abspath(__file__), 2, env, PREFIX, timeout=3000)
    print(
        f"{layers * WIDTH * WIDTH / 1e6:.0f}M parameters ({mib:.0f} MiB) + SGD momentum, "
        f"{args.strategy}, 2 ranks, gloo, CPU; {args.steps} updates, a checkpoint every "
        f"{args.every}; {args.rounds} round(s)"
    )
    print("seconds: stall per checkpoint (median, max); update without one; last; train()")
    for mode, done in runs.items():
        mid = [s for run in done for s in run["mid"]]
        other = statistics.median(s for run in done for s in run["other"])
        last = statistics.median(run["end"] for run in done)
        whole = statistics.median(run["train"] for run in done)
        stalls = f"{statistics.median(mid):.3f}, {max(mid):.3f}"
        print(f"  {mode:<6} {stalls:>14}   {other:.3f}   {last:.3f}   {whole:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=None, help="100e6; --stall: 50e6")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--stall", action="store_true", help="sync vs async, 2 ranks")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--steps", type=int, default=24, help="--stall: updates per run")
    parser.add_argument("--every", type=int, default=4, help="--stall: checkpoint_every")
    parser.add_argument("--rounds", type=int, default=2, help="--stall: runs of each mode")
    args = parser.parse_args()
    if args.stall:
        args.params = 50e6 if args.params is None else args.params
        stall(args)
        return
    state = payload(100e6 if args.params is None else args.params)
    n = state.pop("params")
    plain, fastdist_ = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        checkpoints = CheckpointDir(os.path.join(tmp, "checkpoints"), keep=1)
        for step in range(args.repeats):  # alternate the two, same payload, same disk state
            plain_file = os.path.join(tmp, f"plain-{step}.pt")
            os.sync()  # no dirty pages of the previous write left to slow this one
            start = time.perf_counter()
            with open(plain_file, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            plain.append(time.perf_counter() - start)
            size = os.path.getsize(plain_file)
            os.remove(plain_file)
            os.sync()
            start = time.perf_counter()
            checkpoints.save(state, step)  # also prunes the previous one (keep=1)
            fastdist_.append(time.perf_counter() - start)
    p, f = statistics.median(plain), statistics.median(fastdist_)
    print(f"model {n / 1e6:.0f}M parameters + momentum: {size / 2**20:.0f} MiB per checkpoint")
    print(f"torch.save + fsync (median of {args.repeats}): {p:.2f} s")
    print(f"fastdist checkpoint (write, CRC-32, fsync, rename, manifest): {f:.2f} s")
    print(f"ratio fastdist / plain: {f / p:.2f}")


if __name__ == "__main__":
    stall_worker() if "CHECKPOINT_BENCH" in os.environ else main()
