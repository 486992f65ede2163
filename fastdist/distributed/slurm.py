"""Forming the group under SLURM's ``srun`` without torchrun, from SLURM's variables."""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

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
    """
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        or env["SLURM_NTASKS"],
        "GROUP_RANK": env.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(env["SLURM_JOB_NODELIST"]),
        "MASTER_PORT": env.get("MASTER_PORT", str(DEFAULT_PORT)),
    }


def apply_slurm_env(env: MutableMapping[str, str] = os.environ) -> bool:
    """Fill in torchrun's variables from SLURM's; return whether it did."""
    implied = torchrun_env_from_slurm(env)
    env.update(implied)
    return bool(implied)
