"""``python -m fastdist ft``: a torchft Lighthouse and N replica groups on this machine.

It starts ``torchft_lighthouse`` on a free port, then one ``torchrun --standalone`` of
``--procs-per-group`` processes per replica group (torchrun restarts a group's processes when
one fails, up to ``--max-restarts`` times), each with ``FASTDIST_REPLICA_GROUP``,
``FASTDIST_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set for a script that trains with
``DDP(fault_tolerant=True)`` or ``FSDP(fault_tolerant=True)``. It waits for every group,
stops the Lighthouse by its PID and exits with the worst group's status. A ``SIGTERM`` to it
(a scheduler pre-empting the job) goes on to every group's torchrun, which hands it to its
processes (each group checkpoints and stops, as a pre-empted torchrun job does); then the
Lighthouse is stopped. No launcher or rendezvous of its own: torchrun runs each group,
torchft's Lighthouse joins them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fastdist.strategies.replica_groups import GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "ft",
        help="run a script as N torchft replica groups under one Lighthouse, on this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("script", help="the training script (its arguments after --)")
    parser.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="fewest groups a quorum needs (default 1)"
    )
    parser.add_argument(
        "--procs-per-group",
        type=int,
        default=1,
        help="processes of each group (torchrun's --nproc-per-node; default 1)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="torchrun's restarts of a group (default 3)"
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="the Lighthouse drops a group silent this long (default 5000)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=2000,
        help="the Lighthouse waits this long for stragglers to join a quorum (default 2000)",
    )
    parser.set_defaults(run=run, script_args=[])


def run(args: argparse.Namespace) -> int:
    """Start the Lighthouse and the groups, wait for the groups, stop the Lighthouse."""
    if args.groups < 1 or not 1 <= args.min_replicas <= args.groups:
        raise SystemExit(
            f"--groups {args.groups} and --min-replicas {args.min_replicas}: need "
            "1 <= --min-replicas <= --groups"
        )
    for option, value, least in (
        ("--procs-per-group", args.procs_per_group, 1),
        ("--max-restarts", args.max_restarts, 0),
        ("--heartbeat-timeout-ms", args.heartbeat_timeout_ms, 1),
        ("--join-timeout-ms", args.join_timeout_ms, 0),
    ):
        if value < least:
            raise SystemExit(f"{option} {value}: need {least} or more")
    if not os.path.isfile(args.script):
        raise SystemExit(f"{args.script}: no such training script (give the path of a .py file)")
    binary = shutil.which("torchft_lighthouse") or str(
        Path(sys.executable).parent / "torchft_lighthouse"
    )
    if not os.path.exists(binary):
        raise SystemExit('torchft_lighthouse not found: pip install "fastdist[ft]"')
    port = _free_port()
    lighthouse = subprocess.Popen(
        [
            binary,
            f"--min_replicas={args.min_replicas}",
            f"--bind=[::]:{port}",
            "--quorum_tick_ms=100",
            f"--join_timeout_ms={args.join_timeout_ms}",
            f"--heartbeat_timeout_ms={args.heartbeat_timeout_ms}",
        ]
    )
    groups: list[subprocess.Popen[bytes]] = []
    signalled: list[int] = []

    def pass_on(signum: int, _: Any) -> None:  # to each torchrun, which signals its processes
        signalled.append(signum)
        for group in groups:
            if group.poll() is None:
                group.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, pass_on)
    try:
        wait_listening(port, lighthouse, 30.0)
        url = f"http://localhost:{port}"
        print(f"fastdist ft: Lighthouse at {url} (PID {lighthouse.pid})", flush=True)
        for index in range(args.groups):
            if signalled:  # pre-empted while starting: start no more
                break
            env = {**os.environ, GROUP_VAR: str(index), GROUPS_VAR: str(args.groups)}
            env[LIGHTHOUSE_VAR] = url
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [f"--nproc-per-node={args.procs_per_group}"]
            cmd += [f"--max-restarts={args.max_restarts}"]
            groups.append(subprocess.Popen([*cmd, args.script, *args.script_args], env=env))
        return max([group.wait() for group in groups] or [128 + signal.SIGTERM])
    finally:
        for proc in [*groups, lighthouse]:
            _stop(proc)
        signal.signal(signal.SIGTERM, previous)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait until ``proc`` (the Lighthouse) accepts connections on ``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"torchft_lighthouse exited with status {proc.returncode}")
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"torchft_lighthouse did not listen on port {port} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate ``proc`` by its PID if it still runs; kill it after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
