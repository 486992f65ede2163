"""Benchmark runs under torchrun: fastdist's ``DistTrainer`` and a hand-written DDP loop.

Launched by ``benchmarks/run.py`` with ``--runs``, e.g. ``fastdist:0,hand:0,fastdist:10``
(loop and ``print_every``, 0: more than all updates): the runs follow one another in the same
processes and process group, so they share the cores, the placement and the connections that
make separate launches differ by several percent here. After each run rank 0 prints one line
``BENCH_JSON {...}``. Both loops train the same model on the same data in the same order (same
seeds, same sampler epochs), so their final weights agree and the checksums are the same.

Timing covers the steady state: from the end of optimizer update ``warmup`` to the end of
training (after the last epoch), on every rank; the reported time is the maximum over ranks.
Process start-up, the process group, DDP construction and the warm-up updates are excluded.
"""

import argparse
import contextlib
import gc
import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from workloads import (
    SAMPLER_SEED,
    WORKLOADS,
    Workload,
    build_data,
    build_model,
    build_optimizer,
    plan,
)

RESULT_PREFIX = "BENCH_JSON "


@dataclass
class CommCounter:
    """All-reduce calls and bytes: DDP gradient buckets (comm hook) and explicit calls."""

    ddp_calls: int = 0
    ddp_bytes: int = 0
    explicit_calls: int = 0
    explicit_bytes: int = 0
    in_hook: bool = False  # the default hook calls dist.all_reduce itself: not "explicit"

    def snapshot(self) -> dict[str, int]:
        counts = asdict(self)
        del counts["in_hook"]
        return counts


COUNTER = CommCounter()


def counting_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Count one gradient bucket, then run torch's default all-reduce hook on it.

    (This module does not use ``from __future__ import annotations``: DDP checks these
    annotations at registration and rejects string ones.)
    """
    buffer = bucket.buffer()
    COUNTER.ddp_calls += 1
    COUNTER.ddp_bytes += buffer.numel() * buffer.element_size()
    COUNTER.in_hook = True
    try:
        return default_hooks.allreduce_hook(state, bucket)
    finally:
        COUNTER.in_hook = False


def install_all_reduce_counter() -> None:
    """Wrap ``torch.distributed.all_reduce`` to count explicit (non-DDP) all-reduces.

    An all-reduce over a group of one rank (post-local SGD's per-rank subgroups) sends nothing
    and is not counted.
    """
    original = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if not COUNTER.in_hook and dist.get_world_size(group) > 1:
            COUNTER.explicit_calls += 1
            COUNTER.explicit_bytes += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce  # type: ignore[assignment]


@dataclass
class Timing:
    """Start/end timestamps and communication counters at those points."""

    t0: float = 0.0
    t1: float = 0.0
    cpu0: float = 0.0  # CPU seconds of the whole process (all threads)
    cpu1: float = 0.0
    thread0: float = 0.0  # CPU seconds of the main (training) thread alone
    thread1: float = 0.0
    comm0: dict[str, int] | None = None
    comm1: dict[str, int] | None = None

    def start(self, sync: Callable[[], None]) -> None:
        sync()
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()
        self.thread0 = time.thread_time()
        self.comm0 = COUNTER.snapshot()

    def stop(self, sync: Callable[[], None]) -> None:
        sync()
        self.t1 = time.perf_counter()
        self.cpu1 = time.process_time()
        self.thread1 = time.thread_time()
        self.comm1 = COUNTER.snapshot()


def make_sync(device: torch.device) -> Callable[[], None]:
    """Return a function that waits for queued device work (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def run_hand(
    wl: Workload,
    data: TensorDataset,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    epochs: int,
    backend: str,
) -> Timing:
    """The hand-written DDP loop: DistributedSampler, DataLoader, DDP, no_sync accumulation."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = backend == "nccl"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    model.to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    if wl.count_comm:
        ddp.register_comm_hook(None, counting_hook)
    sampler = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=SAMPLER_SEED
    )
    loader = DataLoader(data, batch_size=wl.batch_size, sampler=sampler, pin_memory=cuda)
    loss_fn = nn.CrossEntropyLoss()
    sync, timing, step = make_sync(device), Timing(), 0
    # Epochs from 1, as DistTrainer numbers them, so both loops see the same shuffles.
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            update = (i + 1) % wl.update_every == 0
            with contextlib.nullcontext() if update else ddp.no_sync():
                loss = loss_fn(ddp(x), y) / wl.update_every
                loss.backward()
            if update:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step == wl.warmup:
                    timing.start(sync)
    timing.stop(sync)
    return timing


def run_fastdist(
    wl: Workload,
    data: TensorDataset,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    epochs: int,
    backend: str,
    print_every: int,
) -> Timing:
    """The same training with ``fastdist.DistTrainer`` (no dev data, no progress bar)."""
    from fastdist import DistTrainer
    from fastdist.callbacks import Callback

    timing = Timing()

    class BenchCallback(Callback):
        """Registers the counting comm hook and takes the timestamps."""

        def on_train_begin(self) -> None:
            self.sync = make_sync(self.trainer.device)
            ddp_model = self.trainer.strategy.module
            if wl.count_comm and isinstance(ddp_model, DistributedDataParallel):
                ddp_model.register_comm_hook(None, counting_hook)

        def on_step_end(self) -> None:
            if self.trainer.state.global_step == wl.warmup:
                timing.start(self.sync)

        def on_train_end(self) -> None:
            timing.stop(self.sync)

    trainer = DistTrainer(
        train_data=data,
        model=model,
        optimizer=optimizer,
        loss=nn.CrossEntropyLoss(),
        callbacks_all=[BenchCallback()],
        batch_size_per_gpu=wl.batch_size,
        n_epochs=epochs,
        update_every=wl.update_every,
        print_every=print_every,
        device="cuda" if backend == "nccl" else "cpu",
        use_tqdm=False,
        seed=SAMPLER_SEED,
        load_best_model=False,
    )
    trainer.train()
    return timing


def checksum(model: nn.Module) -> float:
    """Sum of all parameters in float64: equal final weights give equal checksums."""
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--runs", required=True, help="comma-separated LOOP:PRINT_EVERY, LOOP fastdist or hand"
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer updates")
    parser.add_argument(
        "--profile", default=None, help="write a cProfile of every rank to PROFILE.rank<N>"
    )
    args = parser.parse_args()
    runs = [(loop, int(every)) for loop, every in (r.split(":") for r in args.runs.split(","))]
    if any(loop not in ("fastdist", "hand") for loop, _ in runs):
        parser.error(f"--runs: each loop must be fastdist or hand, got {args.runs!r}")
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # One group for every run (fastdist uses the group it finds); also with one process.
    dist.init_process_group(backend=args.backend)
    install_all_reduce_counter()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for loop, print_every in runs:
        run(args, loop, print_every)
        gc.collect()  # free this run's DDP module (trainer and callbacks form cycles)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{args.profile}.rank{dist.get_rank()}")
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace, loop: str, print_every: int) -> None:
    """Build the workload, train it with ``loop`` and report from rank 0."""
    wl = WORKLOADS[args.workload]
    world = dist.get_world_size()
    epochs, per_epoch, size = plan(wl, world, args.steps)
    total = epochs * per_epoch
    data = build_data(wl, size)
    model = build_model(wl)
    optimizer = build_optimizer(model)
    print_every = print_every or total + 1
    if loop == "hand":
        timing = run_hand(wl, data, model, optimizer, epochs, args.backend)
    else:
        timing = run_fastdist(wl, data, model, optimizer, epochs, args.backend, print_every)

    # Everything below is outside the timed region.
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    mine = {
        "elapsed": timing.t1 - timing.t0,
        "cpu": timing.cpu1 - timing.cpu0,
        "thread_cpu": timing.thread1 - timing.thread0,
        "rss_mib": rss_mib,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    timed_updates = total - wl.warmup
    samples = timed_updates * wl.batch_size * wl.update_every * world
    elapsed = max(g["elapsed"] for g in gathered)
    comm0, comm1 = timing.comm0 or {}, timing.comm1 or {}
    per_update = {k: (comm1[k] - comm0[k]) / timed_updates for k in comm1}
    result = {
        "loop": loop,
        "print_every": print_every if loop == "fastdist" else None,
        "workload": wl.name,
        "backend": args.backend,
        "nproc": world,
        "epochs": epochs,
        "total_updates": total,
        "timed_updates": timed_updates,
        "samples": samples,
        "elapsed_s": elapsed,
        "samples_per_s": samples / elapsed,
        "cpu_s_ranks": [g["cpu"] for g in gathered],
        "main_thread_cpu_s_ranks": [g["thread_cpu"] for g in gathered],
        "samples_per_cpu_s": samples / sum(g["cpu"] for g in gathered),
        "rss_mib_max": max(g["rss_mib"] for g in gathered),  # of the process so far
        "rss_mib_ranks": [g["rss_mib"] for g in gathered],
        "comm_per_update": per_update if wl.count_comm else None,
        "checksum": checksum(model),
    }
    if dist.get_rank() == 0:
        print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
