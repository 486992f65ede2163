"""What the benchmark drivers share: ports, the workers' environment, one torchrun job, rounds
of loops in alternating order."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from fastdist.distributed.env import TORCHRUN_VARS


def busy_jiffies() -> int:
    """Non-idle CPU time of the whole machine so far, in clock ticks (``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without torchrun's variables, one thread per process, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, **(extra or {}))
    return env


def torchrun_command(script: str, nproc: int, args: list[str] | None = None) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` with ``nproc`` workers on 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        os.path.abspath(script),
        *(args or []),
    ]


def run_job(script: str, nproc: int, env: dict[str, str], prefix: str, timeout: float) -> dict:
    """Run ``script`` under torchrun on 127.0.0.1; return the JSON rank 0 printed after ``prefix``.

    The workers' options travel in ``env``: torchrun's parser would read an option such as
    ``--n=...`` after the script as an abbreviation of its own ``--nnodes``.
    """
    cmd = torchrun_command(script, nproc)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(prefix)]
    if proc.returncode != 0 or len(lines) != 1:
        raise SystemExit(
            f"worker failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    result: dict[str, Any] = json.loads(lines[0][len(prefix) :])
    return result


def alternating(loops: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each loop's result per round, the loops' order flipped every round (no loop always goes
    first)."""
    results: dict[str, list[float]] = {name: [] for name in loops}
    for round_ in range(rounds):
        for name in list(loops)[:: -1 if round_ % 2 else 1]:
            results[name].append(loops[name]())
    return results
