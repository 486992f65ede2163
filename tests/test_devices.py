"""Devices and process-group formation on any machine: one GPU per process or a clear error,
CPU tests pinned to the CPU, and a group that cannot form fails within the timeout.

The GPU checks run here on CPU through their pure parts (``gpu_shortage``,
``resolve_device(gpu_count=...)``, ``agreed_backend``); tests/test_gpu.py and
tests/test_gpu_multi.py run them on real GPUs.
"""

from __future__ import annotations

import time

import pytest
import torch
from launch import GPU_ENV, free_port, run_python

import fastdist
from fastdist.distributed.env import agreed_backend, gpu_shortage
from fastdist.trainer.arguments import resolve_device


def test_gpu_shortage_names_the_counts_and_the_fixes() -> None:
    message = gpu_shortage(local_rank=1, local_world_size=2, gpu_count=1)
    assert message is not None
    for words in (
        "LOCAL_WORLD_SIZE=2 processes on this node but 1 visible GPU(s)",
        "torchrun --nproc-per-node=1",
        "CUDA_VISIBLE_DEVICES",
        "device='cpu'",
    ):
        assert words in message, message
    # Node-wide numbers: local rank 0, which has a GPU, raises the same error as rank 1.
    assert gpu_shortage(local_rank=0, local_world_size=2, gpu_count=1) == message
    assert gpu_shortage(local_rank=1, local_world_size=2, gpu_count=2) is None
    assert gpu_shortage(local_rank=0, local_world_size=1, gpu_count=8) is None
    assert gpu_shortage(local_rank=0, local_world_size=1, gpu_count=0) is not None


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_auto_device_takes_the_local_ranks_gpu_or_the_one_it_sees(
    local_rank: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for device in ("auto", None, "cuda"):
        # One visible GPU: a scheduler's own GPU per process, or one shared (refused when the
        # group forms, see below).
        assert resolve_device(device, gpu_count=1) == torch.device("cuda", 0)
        assert resolve_device(device, gpu_count=2) == torch.device("cuda", int(local_rank))
    assert resolve_device("cuda:0", gpu_count=1) == torch.device("cuda", 0)  # shared on purpose
    assert resolve_device("auto", gpu_count=0) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device='cuda:1' but 1 GPU\(s\) are visible"):
        resolve_device("cuda:1", gpu_count=1)
    with pytest.raises(ValueError, match="CUDA is not available here: use device='cpu'"):
        resolve_device("cuda", gpu_count=0)


def test_the_backend_is_agreed_from_every_ranks_gpu() -> None:
    """nccl only when every rank has a GPU of its own: f"cuda:{LOCAL_RANK}" (was gloo), or one
    visible GPU per process set by a scheduler (was refused); sharing one is gloo, or refused
    where each process asked for its own (device="auto")."""
    own = ["node1/GPU-a", "node1/GPU-b"]
    if torch.distributed.is_nccl_available():
        assert agreed_backend(own, exclusive=True) == "nccl"
        assert agreed_backend(["node1/GPU-a", "node2/GPU-a"], exclusive=True) == "nccl"
    shared = ["node1/GPU-a", "node1/GPU-a"]
    assert agreed_backend(shared, exclusive=False) == "gloo"
    with pytest.raises(ValueError, match=r"ranks \[\[0, 1\]\] see the same GPU.*device='cuda:0'"):
        agreed_backend(shared, exclusive=True)
    assert agreed_backend(["", ""], exclusive=True) == "gloo"  # CPU
    assert agreed_backend(["node1/GPU-a", ""], exclusive=False) == "gloo"  # mixed


@pytest.mark.slow
def test_launched_tests_see_no_gpu_unless_they_ask() -> None:
    code = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    assert run_python("-c", [code], timeout=60).stdout.strip() == "''"
    asked = run_python("-c", [code], timeout=60, env=GPU_ENV).stdout.strip()
    assert asked == repr(GPU_ENV["CUDA_VISIBLE_DEVICES"])


@pytest.mark.slow
def test_group_formation_fails_within_the_timeout() -> None:
    """env:// as torchrun gives it, but rank 1 never comes: rank 0 raises after ~3 s."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    code = "import fastdist; fastdist.init_distributed(timeout=3)"
    start = time.monotonic()
    result = run_python("-c", [code], timeout=90, env=env, check=False)
    assert result.returncode != 0
    assert time.monotonic() - start < 30, result.describe()
    assert (
        f"RuntimeError: rank 0 could not form the process group (backend gloo, env:// at "
        f"127.0.0.1:{env['MASTER_PORT']}, torchrun restart 0) within 3 s" in result.output
    ), result.describe()


def test_tcp_formation_error_names_the_rendezvous(no_dist_env: None) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: rank 1 cannot reach rank 0
    with pytest.raises(RuntimeError, match=rf"rank 1 could not form .*{url}.* within 2 s"):
        fastdist.init_distributed(init_method=url, rank=1, world_size=2, timeout=2)
