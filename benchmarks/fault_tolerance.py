"""Per-step fault tolerance on torchft: its cost per update, and the recovery from a lost group.

Run on demand from the repository root (CPU, gloo, on 127.0.0.1)::

    python benchmarks/fault_tolerance.py [--rounds 2] [--updates 120] [--layout 2x2]

Cost: the same training (an MLP of 1.3 M parameters, batch 32 per process, SGD) as plain DDP
(torchrun, 2 ranks) and as ``DDP(fault_tolerant=True)`` (``python -m fastdist ft``, 2 groups
of one process: a quorum with the Lighthouse, torchft's all-reduce and ``should_commit`` every
update), alternately (``common.alternating``); the median wall time per update after 10
warm-up updates, per run. Recovery: one more fault-tolerant run in which group 1 SIGKILLs
itself after update 20: how long group 0's updates stall at the failure, and how long from
the kill until both groups commit an update together again (torchrun's restart of the group,
its start-up and its heal included).

``--layout 2x2``: groups of 2 processes instead: ``FSDP(replicate=2)`` (HSDP on 4 torchrun
ranks) against ``FSDP(fault_tolerant=True)`` as 2 groups of 2 processes (the same layout,
its replicate dimension torchft's); group 1's two ranks die together.

``--worker OUT`` is the training script both launches run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import alternating, child_env, torchrun_command  # noqa: E402


def worker(out: Path, updates: int, kill_step: int, layout: str) -> None:
    """Train, appending each update's time and participating groups to
    ``OUT/<group or rank>.<attempt>.jsonl`` (a group's rank 0 writes)."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import fastdist
    from fastdist import DistTrainer
    from fastdist.callbacks import Callback
    from fastdist.strategies import DDP, FSDP

    ft = "FASTDIST_REPLICA_GROUP" in os.environ
    name = os.environ.get("FASTDIST_REPLICA_GROUP", os.environ.get("RANK", "0"))
    writes = not ft or os.environ.get("RANK", "0") == "0"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = out / f"{name}.{attempt}.jsonl"

    class Record(Callback):
        def on_step_end(self) -> None:
            strategy, step = self.trainer.strategy, self.trainer.state.global_step
            groups = strategy.torchft.manager.num_participants() if ft else 2
            if writes:
                with open(log, "a") as f:
                    record = {"step": step, "t": time.time(), "groups": groups}
                    f.write(json.dumps(record) + "\n")
            if step == kill_step and name == "1" and attempt == "0":
                os.kill(os.getpid(), signal.SIGKILL)

    fastdist.set_seed(0)
    x = torch.randn(64 * 60, 256)  # 60 updates an epoch
    data = TensorDataset(x, torch.randint(0, 10, (64 * 60,)))
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU())
    model.append(nn.Linear(1024, 10))
    strategy = DDP(fault_tolerant=ft)
    if layout == "2x2":
        strategy = FSDP(fault_tolerant=True) if ft else FSDP(replicate=2)
    DistTrainer(
        train_data=data,
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        strategy=strategy,
        callbacks_all=[Record()],
        batch_size_per_gpu=32,
        n_epochs=max(1, updates // 60),
        timeout=60,
        print_every=1000,
        device="cpu",
    ).train()


def launch(ft: bool, updates: int, layout: str, kill_step: int = -1) -> dict[str, list[dict]]:
    """One job; every process attempt's records."""
    out = Path(tempfile.mkdtemp(prefix="fastdist-ft-bench-"))
    script = [str(Path(__file__).resolve()), "--worker", str(out), "--updates", str(updates)]
    script += ["--kill-step", str(kill_step), "--layout", layout]
    per_group = 2 if layout == "2x2" else 1
    if ft:
        cmd = [sys.executable, "-m", "fastdist", "ft", "--groups", "2", "--min-replicas", "1"]
        cmd += ["--procs-per-group", str(per_group), "--max-restarts", "1"]
        cmd += ["--heartbeat-timeout-ms", "1000", script[0], "--", *script[1:]]
    else:
        cmd = torchrun_command(script[0], 2 * per_group, script[1:])
    env = child_env({"PYTHONPATH": str(HERE.parent)})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return {p.stem: [json.loads(line) for line in p.open()] for p in out.glob("*.jsonl")}


def per_update_ms(records: dict[str, list[dict]]) -> float:
    """Rank/group 0's median wall time per update after 10 warm-up updates."""
    times = [r["t"] for r in records["0.0"]][10:]
    return 1000 * statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def recovery(records: dict[str, list[dict]]) -> dict[str, float]:
    """Group 0's longest stall between updates, and the time from the kill to the first
    update both groups committed after it."""
    alive = records["0.0"]
    killed_at = records["1.0"][-1]["t"]  # group 1's last update, just before its SIGKILL
    times = [r["t"] for r in alive]
    after = [r for r in alive if r["t"] > killed_at]
    first_alone = next(i for i, r in enumerate(after) if r["groups"] == 1)
    back = next(r["t"] for r in after[first_alone:] if r["groups"] == 2)
    alone = sum(1 for r in after if r["groups"] == 1)
    stall = max(b - a for a, b in zip(times, times[1:], strict=False))
    return {"stall_s": stall, "full_again_s": back - killed_at, "updates_alone": alone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--updates", type=int, default=120, help="updates per run")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kill-step", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=("1x1", "2x2"), default="1x1", help="groups x procs")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.updates, args.kill_step, args.layout)
        return
    print(f"load average before: {os.getloadavg()}")
    results = alternating(
        {
            "plain": lambda: per_update_ms(launch(False, args.updates, args.layout)),
            "torchft": lambda: per_update_ms(launch(True, args.updates, args.layout)),
        },
        args.rounds,
    )
    for name, values in results.items():
        print(f"{name}: ms per update {[round(v, 1) for v in values]}")
    ratios = [f / d for f, d in zip(results["torchft"], results["plain"], strict=True)]
    print(f"torchft / plain per update: {[round(r, 2) for r in ratios]}")
    kill, long_run = 20, 1200  # group 0 must still train when group 1 is back
    recovered = recovery(launch(True, long_run, args.layout, kill))
    print(f"recovery, group 1 killed after update {kill}: {recovered}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
