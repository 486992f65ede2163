"""``python -m fastdist env``: what a bug report needs, and whether a process group forms here.

Prints the fastdist, torch, Python and platform versions, CUDA and its devices, which
torch.distributed backends are built in, the torchrun (and NCCL/gloo) environment variables this
process sees, and a last ``verdict:`` line. The verdict comes from really forming a one-process
gloo group over ``tcp://127.0.0.1`` (then destroying it) and from checking the torchrun
variables the way :class:`~fastdist.DistTrainer` reads them.

Example:
    $ python -m fastdist env
    $ torchrun --nproc-per-node=2 -m fastdist env   # what each rank sees
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import sys
from typing import Any

from fastdist.checks import first_line
from fastdist.distributed.env import REQUIRED_VARS, TORCHRUN_VARS, gpu_shortage

# Other variables that change how devices and backends behave.
OTHER_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "GLOO_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)


def add_parser(commands: Any) -> None:
    """Register the ``env`` command on the ``python -m fastdist`` sub-parsers."""
    parser = commands.add_parser(
        "env",
        help="print versions, CUDA, backends, torchrun variables and a process-group verdict",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--no-check", action="store_true", help="do not try to form a process group"
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=10.0,
        help="seconds the process-group check may take (default: 10)",
    )
    parser.set_defaults(run=run)


def _seconds(value: str) -> float:
    """``--timeout``: a number of seconds above 0 (at most a day)."""
    seconds = float(value)
    if not 0 < seconds <= 86400:
        raise argparse.ArgumentTypeError(f"must be seconds above 0, at most 86400, got {value}")
    return seconds


def run(args: argparse.Namespace) -> int:
    """Print the report; return 0, or 1 when the verdict is that training would fail here."""
    ok, lines = report(check=not args.no_check, timeout=args.timeout)
    width = max(len(key) for key, _ in lines)
    for key, value in lines:
        print(f"{key + ':':<{width + 1}} {value}")
    return 0 if ok else 1


def report(check: bool = True, timeout: float = 10.0) -> tuple[bool, list[tuple[str, str]]]:
    """Collect the report as ``(key, value)`` lines, the verdict last; return ``(ok, lines)``.

    Args:
        check: form (and destroy) a one-process gloo group on 127.0.0.1 to prove it works.
        timeout: seconds that check may take before it counts as failed.

    Example:
        >>> ok, lines = report(check=False)
        >>> dict(lines)["torch"]
        '2.13.0+cpu'
    """
    import torch
    import torch.distributed as dist

    import fastdist

    lines: list[tuple[str, str]] = [
        ("fastdist", f"{fastdist.__version__} ({os.path.dirname(fastdist.__file__)})"),
        ("torch", torch.__version__),
        ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("executable", sys.executable),
        ("platform", platform.platform()),
        ("cpu cores", str(os.cpu_count())),
    ]
    cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if cuda else 0
    lines.append(("torch built with CUDA", str(torch.version.cuda)))
    lines.append(("CUDA available", f"{cuda} ({n_gpus} device(s))"))
    for i in range(n_gpus):
        major, minor = torch.cuda.get_device_capability(i)
        lines.append((f"cuda:{i}", f"{torch.cuda.get_device_name(i)} (capability {major}.{minor})"))
    if cuda:
        lines.append(("cuDNN", str(torch.backends.cudnn.version())))
    dist_ok = dist.is_available()
    nccl = dist_ok and dist.is_nccl_available()
    gloo = dist_ok and dist.is_gloo_available()
    lines.append(("torch.distributed", str(dist_ok)))
    lines.append(("NCCL available", f"{nccl}{_nccl_version(torch) if nccl else ''}"))
    lines.append(("gloo available", str(gloo)))
    lines.append(("MPI available", str(dist_ok and dist.is_mpi_available())))
    seen = [f"{name}={os.environ[name]}" for name in TORCHRUN_VARS if name in os.environ]
    lines.append(("torchrun variables", " ".join(seen) or "none (not launched by torchrun)"))
    other = [f"{name}={os.environ[name]}" for name in OTHER_VARS if name in os.environ]
    lines.append(("other variables", " ".join(other) or "none"))

    problems = _launch_problems(cuda, nccl, n_gpus)
    if not gloo:
        problems.append("gloo is not built into this torch: CPU training cannot form a group")
    checked = check and dist_ok and gloo
    if checked:
        formed, detail = check_process_group(timeout)
        lines.append(("process group check", detail))
        if not formed:
            problems.append(f"no gloo process group could be formed here ({detail})")
    lines.append(("verdict", _verdict(problems, cuda, nccl, checked)))
    return not problems, lines


def check_process_group(timeout: float = 10.0) -> tuple[bool, str]:
    """Form a one-process gloo group on ``tcp://127.0.0.1:<free port>``, all-reduce, destroy it.

    Returns:
        ``(True, what was done)`` or ``(False, the error)``.

    Example:
        >>> check_process_group()
        (True, 'formed a gloo group over tcp://127.0.0.1:40123 (world size 1), all-reduce ok')
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return True, f"a process group already exists (world size {dist.get_world_size()})"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    try:
        dist.init_process_group(
            "gloo",
            init_method=url,
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            value = torch.ones(1)
            dist.all_reduce(value)
            if value.item() != 1.0:
                return False, f"all-reduce over {url} returned {value.item()}, expected 1.0"
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # any failure is the answer, not a crash of the report
        return False, f"{type(exc).__name__}: {first_line(exc, 300)}"
    return True, f"formed a gloo group over {url} (world size 1), all-reduce ok"


def _nccl_version(torch: Any) -> str:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a CPU build, or no NCCL library
        return ""
    text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return f" (version {text})"


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _launch_problems(cuda: bool, nccl: bool, n_gpus: int) -> list[str]:
    """What would make ``DistTrainer`` fail under the torchrun variables this process sees."""
    problems = []
    world = _int_env("WORLD_SIZE")
    missing = [name for name in REQUIRED_VARS if name not in os.environ]
    if world is not None and world > 1 and missing:
        problems.append(
            f"WORLD_SIZE={world} but {', '.join(missing)} not set: DistTrainer would raise; "
            "launch with torchrun"
        )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        if name in os.environ and _int_env(name) is None:
            problems.append(f"{name}={os.environ[name]!r} is not an integer")
    if cuda and not nccl and world is not None and world > 1:
        problems.append("CUDA is available but NCCL is not: pass device='cpu' to use gloo")
    local_rank, local_world = _int_env("LOCAL_RANK"), _int_env("LOCAL_WORLD_SIZE")
    if cuda and (local_rank is not None or local_world is not None):
        local_rank = local_rank or 0
        shortage = gpu_shortage(local_rank, local_world or local_rank + 1, n_gpus)
        if shortage is not None:
            problems.append(f"device='auto' would fail: {shortage}")
    return problems


def _verdict(problems: list[str], cuda: bool, nccl: bool, checked: bool) -> str:
    if problems:
        return "NO: " + "; ".join(problems)
    backend = "nccl" if cuda and nccl else "gloo"
    ok = "OK" if checked else "OK (process group not tried: --no-check)"
    if all(name in os.environ for name in REQUIRED_VARS):
        world, rank = os.environ["WORLD_SIZE"], os.environ["RANK"]
        local = os.environ.get("LOCAL_RANK", "0")
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        text = (
            f"{ok}: under torchrun; a process group would be formed with env:// at {where}, "
            f"backend {backend}, world size {world} (this process: rank {rank}, local rank {local})"
        )
        if world == "1":
            text += "; with world size 1 DistTrainer trains without forming one"
        return text
    return (
        f"{ok}: a process group can be formed here (backend {backend}); not launched by torchrun, "
        "so DistTrainer trains as one process (torchrun --nproc-per-node=N train.py for N)"
    )
