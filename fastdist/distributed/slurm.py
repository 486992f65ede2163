"""SLURM: the group formed under ``srun`` without torchrun, from SLURM's variables; the signal
that asks a job to checkpoint and requeue itself, and the requeue."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from collections.abc import Mapping, MutableMapping

# The fastdist logger (fastdist.logging configures it; this layer sits below it).
logger = logging.getLogger("fastdist")

DEFAULT_PORT = 29500


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,09],cpu1"`` -> ``"gpu03"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def torchrun_env_from_slurm(env: MutableMapping[str, str]) -> dict[str, str]:
    """The torchrun variables a process started by ``srun`` (one task per process) implies.

    Empty when torchrun's variables are already there (``srun torchrun ...``) or this is not a
    SLURM task. ``MASTER_PORT`` defaults to 29500 unless set.

    Raises:
        ValueError: SLURM's variables cannot say the ranks (the same on every task).
    """
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    ntasks, procid = _count("SLURM_NTASKS", env, 1), _count("SLURM_PROCID", env, 0)
    if procid >= ntasks:
        raise ValueError(
            f"SLURM_PROCID={procid} but SLURM_NTASKS={ntasks}: a task's SLURM_PROCID must be "
            f"below SLURM_NTASKS; start every task with one srun (srun -n {procid + 1} or "
            "more), or unset the SLURM_* variables copied from another job"
        )
    if not env.get("MASTER_ADDR") and not env.get("SLURM_JOB_NODELIST"):
        raise ValueError(
            "SLURM_JOB_NODELIST is not set, so the address of task 0 is unknown: start the "
            "tasks with srun inside a job (which sets it), or set MASTER_ADDR to task 0's host"
        )
    port = env.get("MASTER_PORT", str(DEFAULT_PORT)).strip()
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"MASTER_PORT={env['MASTER_PORT']!r} is not a TCP port (an integer from 1 to "
            "65535): set it to a free port on task 0's host, the same for every task, or unset "
            f"it (default {DEFAULT_PORT})"
        )
    return {
        "RANK": str(procid),
        "WORLD_SIZE": str(ntasks),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or str(ntasks),
        "GROUP_RANK": env.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(env["SLURM_JOB_NODELIST"]),
        "MASTER_PORT": port,
    }


def _count(name: str, env: Mapping[str, str], least: int) -> int:
    """The integer SLURM variable ``name``, at least ``least``; else a ``ValueError``."""
    given = env[name].strip()
    if not given.isdigit() or int(given) < least:
        raise ValueError(
            f"{name}={env[name]!r} is not an integer >= {least}: it is SLURM's, so start the "
            f"tasks with srun (which sets it), or unset {name} when not under SLURM"
        )
    return int(given)


def apply_slurm_env(env: MutableMapping[str, str] = os.environ) -> bool:
    """Fill in torchrun's variables from SLURM's; return whether it did."""
    implied = torchrun_env_from_slurm(env)
    env.update(implied)
    return bool(implied)


#: Names the signal after which a SLURM job checkpoints and requeues itself.
REQUEUE_SIGNAL_VAR = "FASTDIST_REQUEUE_SIGNAL"
#: Signals that cannot be the requeue signal: they cannot be caught, or already mean something.
_RESERVED = (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM, signal.SIGINT)


def requeue_signal(env: Mapping[str, str] = os.environ) -> signal.Signals | None:
    """The signal after which the trainer checkpoints and requeues its SLURM job.

    In a SLURM job (``SLURM_JOB_ID`` set) it is ``SIGUSR1``, the one ``#SBATCH
    --signal=B:USR1@90`` sends before the time limit, unless ``FASTDIST_REQUEUE_SIGNAL`` names
    another (``USR2``, ``SIGUSR2`` or its number) or ``none``. Outside SLURM there is none.

    Raises:
        ValueError: ``FASTDIST_REQUEUE_SIGNAL`` names no signal that can be caught, or
            SIGTERM/SIGINT (they stop without a requeue).
    """
    if "SLURM_JOB_ID" not in env:
        return None
    given = env.get(REQUEUE_SIGNAL_VAR, "USR1").strip()
    if given.lower() in ("", "none"):
        return None
    name = given.upper() if given.upper().startswith("SIG") else "SIG" + given.upper()
    try:
        chosen = signal.Signals(int(given)) if given.isdigit() else signal.Signals[name]
    except (KeyError, ValueError):
        chosen = None
    if chosen is None or chosen in _RESERVED:
        raise ValueError(
            f"{REQUEUE_SIGNAL_VAR}={given!r} is not a signal the trainer can requeue on: name "
            "one that #SBATCH --signal= sends and that can be caught, e.g. USR1 (the default) "
            "or USR2, or 'none' to turn requeueing off (SIGTERM and SIGINT already stop a run "
            "with a checkpoint, without a requeue)"
        )
    return chosen


def job_to_requeue(env: Mapping[str, str] = os.environ) -> str:
    """The SLURM job id ``scontrol requeue`` takes for this job (an array task's included)."""
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else env["SLURM_JOB_ID"]


def requeue_job(env: Mapping[str, str] = os.environ) -> bool:
    """``scontrol requeue`` this job, as Lightning's ``auto_requeue`` does: SLURM stops it and
    queues it again (it waits for its begin time, 2 minutes by default). Return whether SLURM
    accepted; a refusal is logged with scontrol's answer."""
    job = job_to_requeue(env)
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60
        )
        failure = None if done.returncode == 0 else (done.stderr or done.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        failure = f"{type(exc).__name__}: {exc}"
    if failure is not None:
        logger.error(
            "scontrol requeue %s failed, so the job is not requeued (%s): submit it again to "
            "resume; a job submitted with --no-requeue, or a cluster with JobRequeue=0, needs "
            "sbatch --requeue",
            job,
            failure,
        )
        return False
    logger.warning("requeued SLURM job %s: when it runs again it resumes from the checkpoint", job)
    return True
