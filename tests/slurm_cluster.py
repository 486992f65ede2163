"""A one-node SLURM cluster on 127.0.0.1 for the SLURM test tier.

Debian's ``munge`` and ``slurm-wlm`` packages provide the daemons (``.ci/run`` installs them);
this module runs ``munged``, ``slurmctld`` and ``slurmd`` in the foreground, each a child of
the caller, with a generated ``slurm.conf``, their key, sockets, state and logs in one
directory of their own and ports that were free a moment ago, so that it touches neither
``/etc`` nor another cluster on the machine. :meth:`SlurmCluster.stop` stops them by PID.
Clients (``srun``, ``sbatch``, ``scontrol``) find the cluster through ``SLURM_CONF``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launch import free_port

#: The daemons, in the order they start.
DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_binaries() -> list[str]:
    """The programs this cluster needs that are not installed."""
    programs = [*DAEMONS, "mungekey", "srun", "sbatch", "scancel", "scontrol", "sinfo"]
    return [name for name in programs if _which(name) is None]


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


@dataclass
class SlurmCluster:
    """A running cluster: its directory, the environment its clients need, its daemons."""

    directory: Path
    node: str
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 30, check: bool = True) -> str:
        """Run a SLURM client (``scontrol ...``) against this cluster; its stdout."""
        done = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited with {done.returncode}: {done.stdout}{done.stderr}\n"
                + self.logs()
            )
        return done.stdout

    def job_field(self, job_id: str, name: str) -> str:
        """One ``Name=value`` field of ``scontrol show job`` (e.g. ``JobState``)."""
        shown = self.run("scontrol", "-o", "show", "job", job_id)
        for item in shown.split():
            key, _, value = item.partition("=")
            if key == name:
                return value
        raise AssertionError(f"no {name} in scontrol show job {job_id}: {shown}")

    def logs(self) -> str:
        """The daemons' logs, for assertion messages."""
        parts = []
        for name in DAEMONS:
            path = self.directory / f"{name}.log"
            text = path.read_text(errors="replace")[-4000:] if path.exists() else "(none)"
            parts.append(f"----- {name}.log -----\n{text}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop every daemon by its PID: SIGTERM, then SIGKILL after 10 s."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start(directory: Path, timeout: float = 60) -> SlurmCluster:
    """Start a one-node cluster in ``directory`` (created, owner-only); wait until its node
    is idle. On failure everything started is stopped and the daemons' logs are raised."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    node = socket.gethostname().split(".")[0]  # slurmctld and slurmd check it is theirs
    conf = directory / "slurm.conf"
    conf.write_text(_config(directory, node))
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(directory, node, env)
    try:
        _check(["mungekey", "--create", f"--keyfile={directory / 'munge.key'}"], env)
        for name, args in _daemon_args(directory).items():
            with open(directory / f"{name}.out", "wb") as log:  # the daemon keeps its copy
                cluster.procs[name] = subprocess.Popen(
                    [_which(name) or name, *args], env=env, stdout=log, stderr=log
                )
            if name == "munged":
                _wait_for(lambda: (directory / "munge.socket").exists(), cluster, timeout)
        _wait_for(lambda: _node_ready(cluster), cluster, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _config(directory: Path, node: str) -> str:
    """A minimal ``slurm.conf``: one node with this machine's CPUs, one partition, requeue on,
    every path inside ``directory``."""
    cpus = os.cpu_count() or 1
    return f"""\
ClusterName=fastdist-test
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={directory / "munge.socket"}
CredType=cred/munge
StateSaveLocation={directory / "state"}
SlurmdSpoolDir={directory / "spool"}
SlurmctldPidFile={directory / "slurmctld.pid"}
SlurmdPidFile={directory / "slurmd.pid"}
SlurmctldLogFile={directory / "slurmctld.log"}
SlurmdLogFile={directory / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _daemon_args(directory: Path) -> dict[str, list[str]]:
    return {
        "munged": [
            "--foreground",
            "--force",
            f"--socket={directory / 'munge.socket'}",
            f"--key-file={directory / 'munge.key'}",
            f"--pid-file={directory / 'munged.pid'}",
            f"--log-file={directory / 'munged.log'}",
            f"--seed-file={directory / 'munged.seed'}",
        ],
        "slurmctld": ["-D", "-i"],  # -i: ignore any state left in the directory
        "slurmd": ["-D"],
    }


def _node_ready(cluster: SlurmCluster) -> bool:
    for name, proc in cluster.procs.items():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}\n{cluster.logs()}")
    with contextlib.suppress(subprocess.SubprocessError):
        state = cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=5)
        return state.strip() == "idle"
    return False


def _wait_for(ready: Callable[[], bool], cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the SLURM cluster did not start in {timeout} s\n{cluster.logs()}")
        time.sleep(0.2)


def _check(cmd: Sequence[str], env: dict[str, str]) -> None:
    subprocess.run(list(cmd), env=env, check=True, capture_output=True, timeout=30)
