"""Time to the first update: fresh 2-process torchrun jobs, fastdist against a hand-written loop.

Run on demand from the repository root (CPU, gloo)::

    python benchmarks/startup.py [--repeats 7] [--nproc 2]

Each job trains one update of a small MLP (batch 32 per rank, SGD), by hand (process group,
``DistributedDataParallel``, ``DistributedSampler``) or with ``DistTrainer`` (defaults), and
rank 0 prints the wall clock at each phase's end, measured from the first line of this file,
before ``import torch``: ``import torch``, the rest of the imports (the hand loop's
``torch.distributed`` and DDP; ``fastdist``, which imports them), the set-up (the hand loop's
process group and wrapping; ``DistTrainer(...)``, which forms the group and wraps the model
itself; either waits there for the other rank to arrive), and the first update
(for fastdist ``train()`` up to the first ``on_step_end``: its start-of-training work is in
it). The launch (torchrun and the interpreter until this file runs) is measured from the
parent. The loops alternate, the order flipping every repeat; the first repeat of each only
warms the page cache and is dropped. Bytecode is cached, as an installed package has it, even
where ``PYTHONDONTWRITEBYTECODE`` is set.
"""

from __future__ import annotations

import time

START = time.time()  # before any import but time's

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

PREFIX = "STARTUP "
PHASES = ("launch", "import torch", "import the rest", "set-up", "first update")
BATCH, WIDTH = 32, 256


def worker(loop: str) -> None:
    """One job's rank: train one update; rank 0 prints the phases' end times."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    marks = {"import torch": time.time()}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
    world = int(os.environ["WORLD_SIZE"])
    data = torch.utils.data.TensorDataset(
        torch.randn(BATCH * world, WIDTH), torch.randint(0, 10, (BATCH * world,))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if loop == "hand":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        marks["import the rest"] = time.time()
        dist.init_process_group("gloo")
        ddp = DistributedDataParallel(model)
        loader = torch.utils.data.DataLoader(
            data, BATCH, sampler=torch.utils.data.DistributedSampler(data)
        )
        marks["set-up"] = time.time()
        for x, y in loader:
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            marks["first update"] = time.time()
            break
        rank = dist.get_rank()
    else:
        from fastdist import Callback, DistTrainer

        marks["import the rest"] = time.time()

        class FirstUpdate(Callback):
            def on_step_end(self) -> None:
                marks.setdefault("first update", time.time())

        trainer = DistTrainer(
            data,
            model,
            optimizer,
            loss=lambda output, batch: F.cross_entropy(output, batch[1]),
            batch_size_per_gpu=BATCH,
            n_epochs=1,
            use_tqdm=False,
            device="cpu",
            callbacks_all=[FirstUpdate()],
        )
        marks["set-up"] = time.time()
        trainer.train()
        rank = trainer.rank
    if rank == 0:
        print(PREFIX + json.dumps({"start": START, **marks}), flush=True)
    # The teardown is not timed, and a DDP reducer freed at the interpreter's exit can wait
    # forever on gloo's thread, which waits for the GIL (seen with torch 2.13).
    os._exit(0)


def job(loop: str, nproc: int, env: dict[str, str]) -> dict[str, float]:
    """One fresh job; each phase's seconds (the launch from the parent's call)."""
    from benchmarks.common import run_job

    launched = time.time()
    marks = run_job(__file__, nproc, {**env, "STARTUP_LOOP": loop}, PREFIX, timeout=120)
    ends = [marks["start"]] + [marks[p] for p in PHASES[1:]]
    phases = {"launch": marks["start"] - launched}
    phases |= {p: ends[i + 1] - ends[i] for i, p in enumerate(PHASES[1:])}
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from benchmarks.common import child_env

    env = child_env({"PYTHONPATH": root})
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the dropped first repeat writes the bytecode
    results: dict[str, list[dict[str, float]]] = {"hand": [], "fastdist": []}
    for i in range(args.repeats + 1):
        for loop in list(results)[:: -1 if i % 2 else 1]:
            phases = job(loop, args.nproc, env)
            if i:
                results[loop].append(phases)
    print(f"{args.nproc} processes, {args.repeats} fresh jobs per loop; median seconds per phase")
    print(f"{'phase':16} {'hand':>8} {'fastdist':>9} {'fastdist - hand':>16}")
    for phase in (*PHASES, "total"):
        med = {
            loop: statistics.median(sum(r.values()) if phase == "total" else r[phase] for r in runs)
            for loop, runs in results.items()
        }
        diff = med["fastdist"] - med["hand"]
        print(f"{phase:16} {med['hand']:8.3f} {med['fastdist']:9.3f} {diff:+16.3f}")


if __name__ == "__main__":
    if "STARTUP_LOOP" in os.environ:
        worker(os.environ["STARTUP_LOOP"])
    else:
        main()
