"""GPU benchmark: ms/step of fastdist's ``DistTrainer`` against a hand-written loop.

Run from the repository root::

    python benchmarks/gpu.py                                    # one GPU
    torchrun --nproc-per-node=2 benchmarks/gpu.py               # 2+ GPUs: DDP over nccl
    python benchmarks/gpu.py --workload transformer --compile   # both loops torch.compile'd
    python benchmarks/gpu.py --device cpu --quick               # smoke test, CPU
    torchrun --nproc-per-node=2 benchmarks/gpu.py --device cpu --quick   # smoke test, gloo

One invocation alternates the two loops (the first loop of a round alternates too) for
``--rounds`` rounds on each workload: the tiny MLP of ``workloads.py`` and a Transformer
encoder classifier large enough to keep an H100 busy. Both loops train the same model (same
seed), data, AdamW and sampler order; batches come from the same pinned CPU ``DataLoader``
path and are copied to the GPU with ``non_blocking=True``. The clock covers the updates after
``--warmup`` ones, with ``torch.cuda.synchronize`` at both ends; the time per step is the
slowest rank's. With one process neither loop uses DDP (fastdist does not wrap a one-process
model); with several, the hand loop is ``DistributedDataParallel`` on the same process group.
fastdist runs with ``print_every`` above the run's updates (no periodic loss read-back), as
the hand loop logs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# The checkout's fastdist, installed or not (the GPU machine may have torch only).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from run import machine_info  # noqa: E402
from worker import Timing, checksum, make_sync  # noqa: E402
from workloads import (  # noqa: E402
    DATA_SEED,
    SAMPLER_SEED,
    SEED,
    WORKLOADS,
    TransformerClassifier,
    build_data,
    build_model,
    build_optimizer,
)

from fastdist import Callback, DistTrainer, logger  # noqa: E402

TARGET = 1.02  # fastdist/hand ms/step, median over the rounds


@dataclass(frozen=True)
class Case:
    """One workload: how to build its model and ``n`` samples, its batch and run length."""

    name: str
    describe: str
    batch: int  # per process
    steps: int  # timed optimizer updates
    warmup: int  # updates before the clock starts
    model: Callable[[], nn.Module]
    data: Callable[[int], TensorDataset]


def transformer_case(quick: bool, steps: int, warmup: int) -> Case:
    """A 6-layer d_model 512 encoder on 32 x 256 tokens (23M parameters); tiny with ``quick``."""
    vocab, seq, d_model, heads, layers, batch = (
        (1000, 32, 64, 4, 2, 8) if quick else (8192, 256, 512, 8, 6, 32)
    )

    def model() -> nn.Module:
        torch.manual_seed(SEED)
        return TransformerClassifier(vocab, seq, d_model, heads, layers)

    def data(n: int) -> TensorDataset:
        gen = torch.Generator().manual_seed(DATA_SEED)
        tokens = torch.randint(0, vocab, (n, seq), generator=gen)
        return TensorDataset(tokens, torch.randint(0, 10, (n,), generator=gen))

    describe = f"vocab {vocab}, seq {seq}, d_model {d_model}, {heads} heads, {layers} layers"
    return Case("transformer", describe, batch, steps, warmup, model, data)


def make_cases(quick: bool, steps: int | None, warmup: int | None) -> dict[str, Case]:
    tiny = WORKLOADS["tiny"]
    mlp = Case(
        "mlp",
        "workloads.py's tiny MLP 64-256-256-10",
        tiny.batch_size,
        steps or (20 if quick else 1000),
        warmup or (3 if quick else 100),
        lambda: build_model(tiny),
        lambda n: build_data(tiny, n),
    )
    transformer = transformer_case(
        quick, steps or (10 if quick else 200), warmup or (3 if quick else 20)
    )
    return {case.name: case for case in (mlp, transformer)}


@dataclass(frozen=True)
class Setup:
    """What both loops run with: the device, autocast (``none``/``bf16``), ``torch.compile``."""

    device: torch.device
    amp: str
    compile: bool


def autocast(setup: Setup) -> contextlib.AbstractContextManager:
    if setup.amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(setup.device.type, dtype=torch.bfloat16)


def hand_loop(case: Case, data: TensorDataset, setup: Setup) -> tuple[float, float]:
    """The loop people write: sampler, pinned DataLoader, DDP when several processes.

    Returns this rank's seconds for the timed updates and the final weights' checksum.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = setup.device
    model = case.model()
    optimizer = build_optimizer(model)
    model.to(device)
    if setup.compile:
        model.compile()  # in place, before DDP wraps it, as fastdist's compile=True
    module: nn.Module = model
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        module = DistributedDataParallel(model, device_ids=ids)
    sampler = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=SAMPLER_SEED
    )
    sampler.set_epoch(1)  # fastdist numbers epochs from 1: the same shuffle
    loader = DataLoader(
        data, batch_size=case.batch, sampler=sampler, pin_memory=device.type == "cuda"
    )
    loss_fn = nn.CrossEntropyLoss()
    sync, timing = make_sync(device), Timing()
    for step, (x, y) in enumerate(loader, start=1):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(setup):
            loss = loss_fn(module(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == case.warmup:
            timing.start(sync)
    timing.stop(sync)
    return timing.t1 - timing.t0, checksum(model)


def fastdist_loop(case: Case, data: TensorDataset, setup: Setup) -> tuple[float, float]:
    """The same training with ``DistTrainer``; the clock in a callback at the same updates."""
    sync, timing = make_sync(setup.device), Timing()
    total = case.warmup + case.steps

    class Clock(Callback):
        def on_step_end(self) -> None:
            step = self.trainer.state.global_step
            if step == case.warmup:
                timing.start(sync)
            elif step == total:
                timing.stop(sync)

    model = case.model()
    trainer = DistTrainer(
        data,
        model,
        build_optimizer(model),
        loss=nn.CrossEntropyLoss(),
        callbacks_all=[Clock()],
        batch_size_per_gpu=case.batch,
        n_epochs=1,
        print_every=total + 1,
        use_tqdm=False,
        device="cuda" if setup.device.type == "cuda" else "cpu",  # cuda: cuda:LOCAL_RANK
        seed=SAMPLER_SEED,
        load_best_model=False,
        amp=None if setup.amp == "none" else setup.amp,
        compile=setup.compile,
    )
    trainer.train(resume=False)
    return timing.t1 - timing.t0, checksum(model)


LOOPS = {"fastdist": fastdist_loop, "hand": hand_loop}


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (after the clock: a collective is fine here)."""
    if not dist.is_initialized():
        return seconds
    everyone: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seconds)
    return max(s for s in everyone if s is not None)


def bench(case: Case, setup: Setup, rounds: int, say: Callable[..., None]) -> float:
    """Alternate the loops for ``rounds`` rounds; print each and return the median ratio."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    data = case.data((case.warmup + case.steps) * case.batch * world)  # one epoch, full batches
    params = sum(p.numel() for p in case.model().parameters()) / 1e6
    say(
        f"\n{case.name}: {case.describe} ({params:.1f}M parameters), batch {case.batch} per "
        f"process, {case.steps} timed steps after {case.warmup} warm-up, amp {setup.amp}, "
        f"compile {'yes' if setup.compile else 'no'}"
    )
    say(f"{'round':>5}  {'first':<9}{'fastdist ms':>12}{'hand ms':>10}{'fastdist/hand':>15}")
    ratios: list[float] = []
    sums: dict[str, set[float]] = {"fastdist": set(), "hand": set()}  # final weights
    for r in range(rounds):
        order = ["fastdist", "hand"] if r % 2 == 0 else ["hand", "fastdist"]
        ms: dict[str, float] = {}
        for loop in order:
            seconds, total = LOOPS[loop](case, data, setup)
            ms[loop] = slowest(seconds) / case.steps * 1e3
            sums[loop].add(total)
            gc.collect()  # free this run's trainer and DDP module (they form cycles)
        ratios.append(ms["fastdist"] / ms["hand"])
        timings = f"{ms['fastdist']:>12.3f}{ms['hand']:>10.3f}{ratios[-1]:>15.4f}"
        say(f"{r + 1:>5}  {order[0]:<9}{timings}")
    median = statistics.median(ratios)
    verdict = "PASS" if median <= TARGET else "MISS"
    same = len(sums["fastdist"] | sums["hand"]) == 1
    say(
        f"median fastdist/hand {median:.4f} (rounds {min(ratios):.4f}..{max(ratios):.4f}): "
        f"{verdict} (target <= {TARGET}); same final weights in every run: "
        f"{'yes' if same else 'no'}"
    )
    if not same:  # run to run (nondeterministic kernels), or fastdist against the hand loop
        say(f"  weight checksums: fastdist {sorted(sums['fastdist'])}, hand {sorted(sums['hand'])}")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: cuda:LOCAL_RANK")
    add("--workload", choices=("mlp", "transformer", "all"), default="all")
    add("--rounds", type=int, default=None, help="default 5 (--quick: 2)")
    add("--steps", type=int, default=None, help="timed steps; default mlp 1000, transformer 200")
    add("--warmup", type=int, default=None, help="untimed steps; default mlp 100, transformer 20")
    add("--amp", choices=("none", "bf16"), default="none", help="autocast in both loops")
    add("--compile", action="store_true", help="torch.compile the model in both loops")
    add("--quick", action="store_true", help="tiny Transformer, few steps: a smoke test")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    if min(rounds, args.steps or 1, args.warmup or 1) < 1:
        parser.error("--rounds, --steps and --warmup must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here: use --device cpu (a smoke test only)")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)  # as every CPU benchmark here: cores shared, not oversubscribed
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1:  # one group for every run; fastdist uses the group it finds
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    master = not dist.is_initialized() or dist.get_rank() == 0
    logger.setLevel(logging.WARNING)  # its per-run INFO lines would break up the tables

    def say(*parts: object) -> None:
        if master:
            print(*parts, flush=True)

    info = machine_info(world)
    backend = dist.get_backend() if dist.is_initialized() else "none (one process, no DDP)"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU smoke test)"
    cuda = torch.version.cuda or "none"
    say(
        f"# {info['date']}  git {info['git']}  torch {info['torch']}  CUDA {cuda}  "
        f"python {info['python']}\n# device {device}: {gpu}; {torch.cuda.device_count()} GPU(s) "
        f"visible; {world} process(es), backend {backend}; {rounds} rounds; CPU {info['cpu']} "
        f"({info['cores']} cores)"
    )
    cases = make_cases(args.quick, args.steps, args.warmup)
    names = list(cases) if args.workload == "all" else [args.workload]
    setup = Setup(device, args.amp, args.compile)
    medians = {name: bench(cases[name], setup, rounds, say) for name in names}
    say("\nsummary (median fastdist/hand ms/step):")
    for name, median in medians.items():
        say(f"  {name:<12}{median:.4f}  {'PASS' if median <= TARGET else 'MISS'} (<= {TARGET})")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
