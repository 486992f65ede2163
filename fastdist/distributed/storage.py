"""Checking that directories every rank writes to are really one shared directory."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from typing import Any

from fastdist.distributed.collectives import all_gather_object, broadcast_object
from fastdist.distributed.env import get_rank, get_world_size


def check_shared_dirs(paths: Iterable[tuple[str, str]], group: Any = None) -> None:
    """Raise on every rank if some rank cannot see a file another rank wrote in a directory.

    Each rank writes a token file into each directory; after a gather every rank looks for
    every rank's token. A path on node-local disk in a multi-node job fails here, before
    training, instead of leaving checkpoints or outputs scattered over the nodes.

    Args:
        paths: ``(argument name, directory)`` pairs, e.g. ``[("save_path", "save")]``.
        group: the process group to agree in.
    """
    paths = list(paths)
    run = broadcast_object(uuid.uuid4().hex, group=group)
    rank, world = get_rank(), get_world_size()
    for _, directory in paths:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f".fastdist-probe-{run}-{rank}"), "w") as f:
            f.write(str(rank))  # visible to the others once this rank reaches the gather
    all_gather_object(None, group)  # every token is written before anyone looks
    unseen = []
    for name, directory in paths:
        token = os.path.join(directory, f".fastdist-probe-{run}-{{}}")
        missing = [r for r in range(world) if not os.path.exists(token.format(r))]
        if missing:
            unseen.append(f"{name}={directory!r}: rank {rank} cannot see the files of {missing}")
    problems = [line for lines in all_gather_object(unseen, group) for line in lines]
    for _, directory in paths:
        os.remove(os.path.join(directory, f".fastdist-probe-{run}-{rank}"))
    if problems:
        details = "; ".join(problems)
        raise ValueError(
            f"directories that every rank must share are not shared: {details}. Put them on a "
            "filesystem every node mounts at the same path (NFS, Lustre...)"
        )
