"""The campaign's faults other than kills: a full disk, a node lost, a network cut.

Each draws its fault point from a seed, runs real processes (torchrun, gloo), checks what the
fault must leave and returns ``(problems, lost)``: what went wrong (empty: survived) and whether
anything trained or saved was lost. Mounting a ``tmpfs`` and making network namespaces needs
root (CI runs as root); elsewhere they raise :class:`NeedsRoot`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from launch import Background, Launch, free_port, run_torchrun, started, torchrun_command

WORKERS = Path(__file__).resolve().parent / "workers"
N_SAMPLES = 72  # resume_worker.N_SAMPLES
Outcome = tuple[list[str], bool]


class NeedsRoot(RuntimeError):
    """The fault needs root here (a mount, a network namespace)."""


def _root(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NeedsRoot(f"{' '.join(cmd)}: {done.stderr.strip()}")


@contextlib.contextmanager
def tmpfs(mount: Path, size: str = "1536k") -> Iterator[Path]:
    """A ``tmpfs`` of ``size`` mounted at ``mount`` (created), unmounted on leaving."""
    mount.mkdir(parents=True)
    _root(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)])
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _wait_for(
    what: str, ready: Callable[[], bool], timeout: float, nodes: Sequence[Background]
) -> None:
    """Wait until ``ready()``; else raise, showing the output of ``nodes`` (launches)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            logs = "\n".join(node.output() for node in nodes)
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{logs}")
        time.sleep(0.1)


def _both_end(nodes: list[Background], what: str, timeout: float) -> float:
    """Wait until both ``nodes`` ended; return the seconds it took."""
    start = time.monotonic()
    _wait_for(what, lambda: all(node.proc.poll() is not None for node in nodes), timeout, nodes)
    return time.monotonic() - start


# ----- a full disk -----


def disk_full(seed: int, out: Path) -> Outcome:
    """The checkpoints' 1.5 MiB filesystem fills after a seeded update of a seeded config (DDP:
    ``.pt`` files, FSDP: DCP directories): every rank raises the same one-line error naming
    the checkpoint; the manifest keeps the newest intact one, no partial one is left; once
    space is freed, the resume starts there and ends with a straight run's parameters."""
    rng = random.Random(seed)
    config, step = rng.choice(["plain", "fsdp"]), rng.randint(1, 8)
    with tmpfs(out / "tmpfs") as disk:
        save, filler = disk / "run", disk / "filler"
        cases = [
            {"name": "straight", "config": config, "save_path": str(out / "straight")},
            {"name": "full", "config": config, "save_path": str(save)},
            {"name": "resumed", "config": config, "save_path": str(save), "resume": "auto"},
        ]
        cases[0]["resume"] = cases[1]["resume"] = False
        cases[1]["fill"] = [step, str(filler), *([0] * (config == "fsdp"))]
        cases[2]["unfill"] = str(filler)
        (out / "cases.json").write_text(json.dumps(cases))
        worker = WORKERS / "checkpoint_worker.py"
        run_torchrun(worker, 2, [str(out / "cases.json"), str(out)], timeout=150)
        outcome = {
            case["name"]: [
                json.loads((out / f"{case['name']}.rank{r}.json").read_text()) for r in (0, 1)
            ]
            for case in cases
        }
        checkpoints = save / "checkpoints"
        left = json.loads((out / "full.left.json").read_text())  # as the full disk left them
    problems = []
    full = outcome["full"]
    failed = checkpoints / f"step-{step + 1:08d}{'.pt' if config == 'plain' else ''}"
    if full[0] != full[1] or not str(full[0].get("error", "")).startswith(
        f"OSError: could not write the checkpoint {failed} "
    ):
        problems.append(f"{config}, disk full after update {step}: errors by rank {full}")
    if any(name.startswith(".tmp-") for name in left["names"]) or failed.name in left["names"]:
        problems.append(f"a partial checkpoint is left: {left['names']}")
    if left["steps"][-1] != step:
        problems.append(f"the manifest's newest is step {left['steps'][-1]}, not {step}")
    resumed, straight = outcome["resumed"], outcome["straight"]
    lost = [r.get("final") for r in resumed] != [r.get("final") for r in straight]
    if [r.get("start_step") for r in resumed] != [step, step]:
        problems.append(f"resumed from {[r.get('start_step') for r in resumed]}, not {step}")
    if lost:
        problems.append(f"the resumed run does not end as a straight run: {resumed}")
    return problems, lost


# ----- a node lost -----


def _attempts(out: Path) -> list[list[dict[str, Any]]]:
    """Every attempt's id log (start line first) of every rank, by start time."""
    logs = [path.read_text().splitlines() for path in out.glob("p*.rank*.ids.jsonl")]
    attempts = [[json.loads(line) for line in lines] for lines in logs if lines]
    return sorted(attempts, key=lambda log: log[0]["start"])


def _trained_once(out: Path, epochs: int) -> list[str]:
    """Whether the updates the final run continued from saw every sample once per epoch."""
    attempts = _attempts(out)
    problems = []
    seen: dict[int, Counter[int]] = {epoch: Counter() for epoch in range(1, epochs + 1)}
    for log in attempts:
        # An attempt's updates count up to where the next attempt started (its ranks start
        # training within milliseconds of each other, after the model's broadcast).
        later = [other[0] for other in attempts if other[0]["start"] > log[0]["start"] + 0.5]
        limit = later[0]["start_step"] if later else None
        for update in log[1:]:
            if limit is None or update["step"] <= limit:
                seen[update["epoch"]].update(update["ids"])
    for epoch, counts in seen.items():
        if counts != Counter(range(N_SAMPLES)):
            wrong = sorted(i for i in range(N_SAMPLES) if counts[i] != 1)
            problems.append(f"epoch {epoch}: samples not trained once: {wrong[:10]}")
    return problems


def node_lost(seed: int, out: Path) -> Outcome:
    """Two torchrun agents of one process each (``--nnodes=1:2``, c10d rendezvous on
    127.0.0.1). After a seeded update the second agent is killed with its worker; the first
    goes on alone from the newest checkpoint; the agent comes back and the job grows to two
    again and ends. Every sample is trained once per epoch, by the updates that count."""
    rng = random.Random(seed)
    kill_after, epochs = rng.randint(2, 6), 3
    port = free_port()
    rdzv = [
        "--nnodes=1:2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=campaign",
        "--rdzv-conf=last_call_timeout=2,join_timeout=60",
        "--max-restarts=3",
        "--monitor-interval=0.1",
    ]
    # Slow while alone only: long enough for the agent to come back before the job ends.
    args = [str(out), "--sleep", "0.05", "--sleep-alone", "0.3", "--epochs", str(epochs)]
    cmd = torchrun_command(WORKERS / "slow_worker.py", 1, args, rdzv)
    # torch 2.13's agents share the rendezvous store with the workers by default; then rank 0
    # publishes MASTER_ADDR in the first round only, and an agent that joins a later round
    # waits for it until its join timeout: the job never grows back (dynamic_rendezvous.py).
    share = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def trained(world: int, updates: int) -> Callable[[], bool]:
        def ready() -> bool:
            logs = [log for log in _attempts(out) if log[0]["world"] == world]
            return bool(logs) and len(logs[-1]) > updates

        return ready

    problems: list[str] = []
    with started(Launch(cmd, share), out / "agent-a.log") as first:
        time.sleep(1)  # agent a hosts the rendezvous store
        with started(Launch(cmd, share), out / "agent-b.log") as second:
            what = f"2 ranks train {kill_after} updates"
            _wait_for(what, trained(2, kill_after), 90, [first, second])
            second.kill()  # the node is lost
        _wait_for("1 rank trains on", trained(1, 2), 90, [first])
        with started(Launch(cmd, share), out / "agent-b2.log") as again:
            _both_end([first, again], "the job ends", 150)
            if (first.proc.returncode, again.proc.returncode) != (0, 0):
                problems.append(f"agents exited {first.proc.returncode}, {again.proc.returncode}")
    worlds = [log[0]["world"] for log in _attempts(out)]
    if worlds[:1] != [2] or 1 not in worlds or worlds[-1] != 2:
        problems.append(f"world sizes by attempt: {worlds}, not 2, then 1, then 2")
    problems += (lost := _trained_once(out, epochs))
    return problems, bool(lost)


# ----- a network cut -----


@contextlib.contextmanager
def two_hosts(name: str) -> Iterator[list[list[str]]]:
    """Two network namespaces ``<name>a`` and ``<name>b`` joined by a veth pair on a private
    /30 (``<name>a0`` 10.230.0.1, ``<name>b0`` 10.230.0.2); yields the command prefix that
    runs a command in each; both namespaces (and so the pair) are deleted on leaving, by name."""
    spaces, links = [f"{name}a", f"{name}b"], [f"{name}a0", f"{name}b0"]
    hosts = [["ip", "netns", "exec", space] for space in spaces]
    try:
        for space in spaces:
            _root(["ip", "netns", "add", space])
        _root(["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]])
        for index, (space, link, host) in enumerate(zip(spaces, links, hosts, strict=True)):
            _root(["ip", "link", "set", link, "netns", space])
            _root([*host, "ip", "addr", "add", f"10.230.0.{index + 1}/30", "dev", link])
            _root([*host, "ip", "link", "set", link, "up"])
            _root([*host, "ip", "link", "set", "lo", "up"])
        yield hosts
    finally:
        for space in spaces:
            subprocess.run(["ip", "netns", "del", space], capture_output=True, check=False)


def network_cut(seed: int, out: Path) -> Outcome:
    """Rank 0 and rank 1 on two hosts (network namespaces); after a seeded update the link
    goes down: both ranks stop within the collective timeout (5 s) and 30 s more, each
    naming the other as not where it is (or unreachable), no hang. With the link back up the
    same command resumes from the newest checkpoint and ends; every sample trained once."""
    rng = random.Random(seed)
    cut_after, timeout = rng.randint(2, 6), 5
    name = f"fd{os.getpid() % 100000}"
    problems: list[str] = []
    with two_hosts(name) as hosts, contextlib.ExitStack() as stack:
        port = free_port()

        def start(tag: str, sleep: float) -> list[Background]:
            args = [str(out), "--sleep", str(sleep), "--epochs", "1", "--timeout", str(timeout)]
            nodes = []
            for node, host in enumerate(hosts):
                options = ["--nnodes=2", f"--node-rank={node}", "--master-addr=10.230.0.1"]
                options += [f"--master-port={port}", "--max-restarts=0"]
                cmd = [*host, *torchrun_command(WORKERS / "slow_worker.py", 1, args, options)]
                env = {"GLOO_SOCKET_IFNAME": f"{name}{'ab'[node]}0"}
                launch = started(Launch(cmd, env), out / f"{tag}-node{node}.log")
                nodes.append(stack.enter_context(launch))
            return nodes

        nodes = start("cut", 0.25)
        trained = lambda: len((_attempts(out) or [[]])[-1]) > cut_after  # noqa: E731
        _wait_for(f"{cut_after} updates", trained, 90, nodes)
        _root([*hosts[0], "ip", "link", "set", f"{name}a0", "down"])
        took = _both_end(nodes, "both ranks stop after the cut", timeout + 60)
        if took > timeout + 30:  # the report waits 5 s for the others, the exit 5 s more
            problems.append(f"the ranks stopped {took:.0f} s after the cut")
        for rank, node in enumerate(nodes):
            said = node.output()
            named = (
                f"ranks not at this rank's position: [{1 - rank}]",
                f"(dead, stuck or cut off): [{1 - rank}]",
            )
            failed = f"a collective failed on rank {rank}" in said
            if not failed or not any(name in said for name in named):
                problems.append(
                    f"rank {rank}'s error does not name rank {1 - rank}:\n{said[-3000:]}"
                )
        _root([*hosts[0], "ip", "link", "set", f"{name}a0", "up"])
        manifest = json.loads((out / "run" / "checkpoints" / "manifest.json").read_text())
        nodes = start("resume", 0)
        _both_end(nodes, "the resumed job ends", 120)
        if [node.proc.returncode for node in nodes] != [0, 0]:
            problems.append(f"the resume failed:\n{nodes[0].output()[-3000:]}")
    resumed = _attempts(out)[-1][0]["start_step"]
    if resumed != manifest[-1]["step"]:
        problems.append(
            f"resumed from {resumed}, not the newest checkpoint's {manifest[-1]['step']}"
        )
    problems += (lost := _trained_once(out, 1))
    return problems, bool(lost)
