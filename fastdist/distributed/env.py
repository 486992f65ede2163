"""Process-group lifecycle and rank queries, with a one-process fallback.

Every function here works without a process group: then the world is one process of rank 0.
Under torchrun the ranks come from its environment variables until a group exists; under
``srun`` from SLURM's (:mod:`~fastdist.distributed.slurm`), and in a Ray Train worker from Ray's
context where its variables are missing (:mod:`~fastdist.distributed.ray_train`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from fastdist.distributed.bounded import STORE_WAIT_S, forget, within
from fastdist.distributed.hang import enable_flight_recorder
from fastdist.distributed.ray_train import ray_train_context, torchrun_env_from_ray
from fastdist.distributed.slurm import apply_slurm_env

# Every variable torchrun sets for its workers.
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)
# The ones a process group is formed from (env://).
REQUIRED_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Under ``srun python train.py`` (no torchrun) SLURM's variables say the ranks.
apply_slurm_env()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name) or _ray_env().get(name)
    return int(value) if value else default


def _ray_env() -> dict[str, str]:
    """The torchrun variables a Ray Train worker's context implies (none elsewhere)."""
    context = ray_train_context()
    return {} if context is None else torchrun_env_from_ray(context)


def get_rank() -> int:
    """Global rank of this process (0 when there is no process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int("RANK", 0)


def get_world_size() -> int:
    """Number of processes in the job (1 when there is no process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def get_local_rank() -> int:
    """Rank of this process on its node, as torchrun's ``LOCAL_RANK`` says (0 by default)."""
    return _env_int("LOCAL_RANK", 0)


def get_local_world_size() -> int:
    """Processes on this node, as torchrun's ``LOCAL_WORLD_SIZE`` says (else local rank + 1)."""
    return _env_int("LOCAL_WORLD_SIZE", get_local_rank() + 1)


def gpu_shortage(local_rank: int, local_world_size: int, gpu_count: int) -> str | None:
    """Why the processes of this node cannot each use a GPU of their own; None when they can.

    It looks at node-wide numbers (``LOCAL_WORLD_SIZE``), not only at this rank, so every
    rank of the node reaches the same verdict and raises alike, before any collective.

    Example:
        >>> gpu_shortage(local_rank=1, local_world_size=2, gpu_count=1)
        'LOCAL_WORLD_SIZE=2 processes on this node but 1 visible GPU(s): ...'
    """
    needed = max(local_world_size, local_rank + 1)
    if needed <= gpu_count:
        return None
    return (
        f"LOCAL_WORLD_SIZE={needed} processes on this node but {gpu_count} visible GPU(s), "
        f"and each process needs its own (cuda:LOCAL_RANK): start at most {gpu_count} per "
        f"node (torchrun --nproc-per-node={gpu_count}), make more GPUs visible "
        "(CUDA_VISIBLE_DEVICES), or train on the CPU (device='cpu')"
    )


def visible_gpu_count() -> int:
    """GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_gpu_shortage() -> str | None:
    """:func:`gpu_shortage` for this process's node, from the environment and torch."""
    return gpu_shortage(get_local_rank(), get_local_world_size(), visible_gpu_count())


def get_node_rank() -> int:
    """Index of this process's node (torchrun's ``GROUP_RANK``; 0 on one node)."""
    local_world = _env_int("LOCAL_WORLD_SIZE", get_world_size())
    return _env_int("GROUP_RANK", get_rank() // max(local_world, 1))


def is_multi_node() -> bool:
    """Whether the job spans several nodes (torchrun's ``LOCAL_WORLD_SIZE`` < world size)."""
    return _env_int("LOCAL_WORLD_SIZE", get_world_size()) < get_world_size()


def is_master() -> bool:
    """Whether this is global rank 0, the process that writes logs, models and files."""
    return get_rank() == 0


def is_distributed() -> bool:
    """Whether a process group with more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def default_backend() -> str:
    """nccl for CUDA tensors plus gloo for CPU tensors when every process of the node has a GPU
    of its own, else gloo alone (which also all-reduces CUDA tensors, e.g. ranks sharing a GPU).
    """
    if torch.cuda.is_available() and dist.is_nccl_available() and node_gpu_shortage() is None:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def gpu_identity(device: torch.device) -> str:
    """The physical GPU behind ``device``: its host and UUID, the same in every process that
    uses it, whatever ``CUDA_VISIBLE_DEVICES`` numbers it there."""
    return f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}"


def agreed_backend(gpus: list[str], exclusive: bool) -> str:
    """The trainer's backend from every rank's :func:`gpu_identity` (``""``: the CPU): nccl when
    every rank has a GPU of its own, else gloo (the CPU, or GPUs shared between ranks, which
    nccl refuses). The same answer on every rank, which sees the same list.

    Raises:
        ValueError: ``exclusive`` (``device="auto"``) and ranks share a GPU.
    """
    shared = sorted({gpu for gpu in gpus if gpu and gpus.count(gpu) > 1})
    if shared and exclusive:
        ranks = [[r for r, gpu in enumerate(gpus) if gpu == one] for one in shared]
        raise ValueError(
            f"device='auto' gives every process a GPU of its own, but ranks {ranks} see the "
            "same GPU: start fewer processes per node (torchrun --nproc-per-node=<GPUs>), make "
            "more GPUs visible (CUDA_VISIBLE_DEVICES), pass device='cuda:0' to share it (over "
            "gloo), or train on the CPU (device='cpu')"
        )
    cuda = all(gpus) and dist.is_nccl_available()
    return "nccl" if cuda and not shared else "gloo"


def init_distributed(
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | None = None,
    device: torch.device | None = None,
    exclusive: bool = False,
) -> bool:
    """Start the default process group unless one exists; return whether a group is running.

    Under torchrun nothing needs to be given: rank, world size and the rendezvous address come
    from the environment (``env://``). Outside torchrun pass ``init_method`` (``tcp://host:port``
    or ``file:///path``) with ``rank`` and ``world_size``. Without torchrun variables and without
    ``init_method`` this is a one-process world and no group is created.

    Args:
        backend: ``"gloo"``, ``"nccl"``...; default nccl when CUDA is available, else gloo.
        init_method: rendezvous URL; default ``env://``.
        rank: global rank of this process; default from ``RANK``.
        world_size: number of processes; default from ``WORLD_SIZE``.
        timeout: seconds a collective may wait before it fails; default torch's.
        device: this rank's device, to choose the backend by (when ``backend`` is ``None``):
            the ranks tell each other their GPUs through the rendezvous store, and get nccl if
            each has one of its own, else gloo (see :func:`agreed_backend`).
        exclusive: with ``device``, refuse GPUs shared between ranks.

    Example:
        >>> fastdist.init_distributed(  # doctest: +SKIP
        ...     init_method="tcp://127.0.0.1:29500", rank=0, world_size=2
        ... )
    """
    if dist.is_initialized():
        return True
    if init_method is None and not all(v in os.environ for v in REQUIRED_VARS):
        if (world_size or 1) > 1:
            raise ValueError(
                f"init_distributed(world_size={world_size}) needs init_method= "
                "(tcp://host:port or file:///path) when not launched by torchrun"
            )
        return False
    if backend is None and device is None:
        backend = default_backend()
    if backend is not None and "nccl" in backend:
        shortage = node_gpu_shortage()
        if shortage is not None:
            raise ValueError(f"backend={backend!r}: {shortage}")
        torch.cuda.set_device(get_local_rank())
    enable_flight_recorder()  # the last collectives of each rank, for a hang report
    url = init_method or "env://"
    limit = None if timeout is None else datetime.timedelta(seconds=timeout)
    try:
        _form_group(backend, url, rank, world_size, limit, device, exclusive)
    except ValueError:  # the ranks' GPUs do not suit the device asked for: said alike on all
        raise
    except Exception as exc:  # any failure: say where, and how long it waited
        if url == "env://":
            url += f" at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        waited = (limit or default_pg_timeout).total_seconds()
        raise RuntimeError(
            f"rank {get_rank() if rank is None else rank} could not form the process group "
            f"(backend {backend}, {url}, torchrun restart {_restart_count()}) within "
            f"{waited:g} s: {type(exc).__name__}: {exc}. Check that all ranks were started and "
            "reach the rendezvous address; init_distributed(timeout=...) or DistTrainer's "
            "timeout= bounds the wait"
        ) from exc
    forget()  # a store that did not answer before was another group's
    # The group is ours: tear it down at exit so torch does not warn about a leaked group.
    atexit.register(_destroy_if_initialized)
    return True


def _restart_count() -> int:
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def _form_group(
    backend: str | None,
    url: str,
    rank: int | None,
    world_size: int | None,
    timeout: datetime.timedelta | None,
    device: torch.device | None,
    exclusive: bool,
) -> None:
    """``init_process_group`` on torch's own rendezvous store for ``url`` under a prefix (of
    the torchrun restart, on torchrun's agent store); ``timeout`` (default torch's) bounds
    every wait, collectives too. Without ``backend``, the ranks first tell each other their
    GPUs through the store."""
    limit = timeout or default_pg_timeout
    store, rank, world_size = next(
        dist.rendezvous(
            url,
            -1 if rank is None else rank,
            -1 if world_size is None else world_size,
            timeout=limit,
        )
    )
    store.set_timeout(limit)
    # torchrun's agent store lives across restarts (the static rendezvous always, c10d unless
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): without the restart in the prefix a restarted
    # group can read the dead workers' gloo addresses ("connectFullMesh ... Connection
    # refused", or a hang). Otherwise rank 0 hosts a new store each round, and the restart
    # count must stay out: an agent that joins an elastic job later counts from 0, so its
    # ranks would wait under another prefix than the others' until the timeout.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.PrefixStore(
        f"fastdist/restart{_restart_count()}" if agent_store else "fastdist", store
    )
    if backend is None:
        assert device is not None
        gpus = _exchange(
            store, rank, world_size, "gpu", gpu_identity(device) if device.type == "cuda" else ""
        )
        backend = agreed_backend(gpus, exclusive)
        if backend == "nccl":
            torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _exchange(store: Any, rank: int, world_size: int, key: str, value: str) -> list[str]:
    """Every rank's ``value``, through the rendezvous store (before a process group exists)."""
    store.set(f"{key}/{rank}", value)
    return [store.get(f"{key}/{r}").decode() for r in range(world_size)]


#: The store key each rank sets when its script ends, and the count of those ranks (read by
#: :func:`fastdist.distributed.position.enter_on_every_rank`).
EXITING, EXITED_COUNT = "fastdist/exiting/{}", "fastdist/exiting"


def _destroy_if_initialized() -> None:
    with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C as the process exits
        _destroy()


def _destroy() -> None:
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # tell ranks waiting for this one not to wait
        store = dist.distributed_c10d._get_default_store()
        key = EXITING.format(get_rank())

        def tell() -> int:
            store.set(key, "")
            return store.add(EXITED_COUNT, 1)

        within(STORE_WAIT_S, tell)
    # Free dead trainers (callbacks and trainer reference each other, so only the cycle
    # collector frees them) while the interpreter is whole: a DDP reducer torn down during
    # interpreter finalization aborts the process ("terminate called without an active
    # exception") now and then.
    gc.collect()
    if getattr(sys, "last_value", None) is None and not _failures:
        # On a clean exit, wait for the peers first: destroying a gloo group while a peer is
        # still tearing down its own also aborts now and then. After an uncaught exception,
        # or a failure this process reported (a script may catch it and sys.exit), there is
        # no waiting (the peers may be gone, or waiting elsewhere): just release the group.
        # A peer that fails meanwhile ends this wait with an error its own report explains.
        with contextlib.suppress(Exception):
            dist.barrier()
    dist.destroy_process_group()


_failures: list[BaseException] = []


def note_failure(exc: BaseException) -> None:
    """Record that this process failed inside a collective job: at exit it does not wait at
    a barrier for peers that may never come."""
    _failures.append(exc)


def ensure_group() -> bool:
    """Create the group from torchrun's environment if the job has several processes."""
    if dist.is_initialized():
        return True
    if get_world_size() > 1:
        missing = [name for name in REQUIRED_VARS if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"WORLD_SIZE={get_world_size()} but {', '.join(missing)} is not set: launch with "
                "torchrun, or call fastdist.init_distributed(init_method=...) first"
            )
        return init_distributed()
    return False
