"""CUDA tests in real launched worlds (marked ``gpu``): ranks sharing one GPU over gloo, nccl at
world size 1, and 2 ranks on 2 GPUs over nccl; skipped, with the reason, without the GPUs.

Each world is launched once per module (tests/workers/gpu_worker.py runs its cases in one
process group) with CUDA visible, unlike the CPU tests' launches. The one-GPU worlds passed on
one H200 (torch 2.11.0+cu130, 2026-11-27); the two-GPU ones have not run yet (no machine with
two GPUs was lent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import GPU_ENV, run_ranks

pytestmark = pytest.mark.slow  # real processes, as every launched test

WORKER = Path(__file__).resolve().parent / "workers" / "gpu_worker.py"
RUNS = ("sgd-128", "adamw-56")  # gpu_worker.case_train's runs
EQUIVALENT = 1e-8  # float64: 2 ranks and 1 rank sum the same gradients in another order

# The first GPU the tests may use, alone: 2 ranks on it must share it.
_visible = GPU_ENV["CUDA_VISIBLE_DEVICES"]
ONE_GPU = {"CUDA_VISIBLE_DEVICES": (_visible or "0").split(",")[0]}


@dataclass(frozen=True)
class Spec:
    """How to launch a world: torchrun or a plain process, its size, device, cases, GPUs."""

    torchrun: bool
    size: int
    device: str
    cases: str
    env: dict[str, str | None]


WORLDS = {
    # The reference: one plain process on one GPU.
    "cuda-1": Spec(False, 1, "cuda:0", "train,resume", ONE_GPU),
    # Two ranks on one visible GPU, named by the script: they share it over gloo.
    "shared-2": Spec(True, 2, "cuda:0", "train,resume", ONE_GPU),
    # torchrun with one process per GPU, one GPU: the group is formed with nccl.
    "nccl-1": Spec(True, 1, "auto", "nccl,train", ONE_GPU),
    # One process per GPU on 2 GPUs: nccl, cuda:LOCAL_RANK.
    "nccl-2": Spec(True, 2, "auto", "train,resume", GPU_ENV),
    # Two ranks told to share cuda:0 while 2 GPUs are visible: gloo too.
    "shared-2-of-2": Spec(True, 2, "cuda:0", "train", GPU_ENV),
    # The spelling most DDP scripts use, f"cuda:{LOCAL_RANK}": each its own GPU, nccl.
    "local-rank-2": Spec(True, 2, "cuda:LOCAL_RANK", "train", GPU_ENV),
    # A scheduler shows each process only its own GPU: device="auto" is cuda:0 there, nccl.
    "own-gpu-2": Spec(True, 2, "auto-own-gpu", "train", GPU_ENV),
}


@dataclass
class World:
    """One launch of the worker: each rank's JSON."""

    name: str
    ranks: list[dict[str, Any]]

    def case(self, name: str) -> list[Any]:
        """Every rank's result of case ``name``."""
        return [data[name] for data in self.ranks]


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], World]:
    """Launch a world on first use and keep it for the module."""
    worlds: dict[str, World] = {}

    def get(name: str) -> World:
        if name not in worlds:
            spec = WORLDS[name]
            out = tmp_path_factory.mktemp(name)
            args = [spec.device, spec.cases, str(out)]
            _, ranks = run_ranks(
                WORKER, spec.size, args, out, spec.torchrun, timeout=240, env=spec.env
            )
            worlds[name] = World(name, ranks)
        return worlds[name]

    return get


def tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def assert_close(got: list[float], want: list[float], atol: float, what: str) -> None:
    diff = (tensor(got) - tensor(want)).abs().max().item()
    assert diff <= atol, f"{what}: max difference {diff:.3g} > {atol:g}"


def check_trained_alike(world: World, reference: World, devices: list[str]) -> None:
    """Every rank: on its device, trained (weights moved), the same weights as every other rank
    bit for bit, and those of one process to float64 tolerance, with the same evaluation."""
    one = reference.case("train")[0]
    for rank, runs in enumerate(world.case("train")):
        for run in RUNS:
            got, ref = runs[run], one[run]
            assert got["param_devices"] == [devices[rank]], f"rank {rank} {run}"
            assert got["init"] == ref["init"] and got["steps"] == ref["steps"] > 0
            assert (tensor(got["final"]) - tensor(got["init"])).abs().max() > 1e-2, "no training"
            assert got["final"] == world.case("train")[0][run]["final"], f"rank {rank} {run}"
            assert_close(got["final"], ref["final"], EQUIVALENT, f"rank {rank} {run} vs 1 rank")
            assert got["best_eval"] == ref["best_eval"], f"rank {rank} {run}"


def check_resume(world: World) -> None:
    """Resuming from update 4's checkpoint ends on the straight run's weights, bit for bit."""
    for rank, runs in enumerate(world.case("resume")):
        straight, resumed = runs["straight"], runs["resumed"]
        assert straight["steps"] == resumed["steps"] == 18
        assert_close(resumed["final"], straight["final"], 0.0, f"rank {rank} resumed")
        assert resumed["final"] == world.case("resume")[0]["resumed"]["final"], f"rank {rank}"


@pytest.mark.gpu
def test_one_process_on_cuda_trains(launch: Callable[[str], World]) -> None:
    (runs,) = launch("cuda-1").case("train")
    for run in RUNS:
        assert runs[run]["param_devices"] == ["cuda:0"] and runs[run]["group_backend"] is None
    check_resume(launch("cuda-1"))


@pytest.mark.gpu
def test_two_ranks_share_one_gpu_over_gloo(launch: Callable[[str], World]) -> None:
    """device="cuda:0" with 2 ranks and 1 GPU: DDP over gloo on CUDA tensors, both on cuda:0."""
    world = launch("shared-2")
    for runs in world.case("train"):
        assert {runs[run]["group_backend"] for run in RUNS} == {"gloo"}
        assert {runs[run]["device"] for run in RUNS} == {"cuda:0"}
    check_trained_alike(world, launch("cuda-1"), ["cuda:0", "cuda:0"])


@pytest.mark.gpu
def test_two_ranks_sharing_one_gpu_resume_bit_exact(launch: Callable[[str], World]) -> None:
    check_resume(launch("shared-2"))


@pytest.mark.gpu
def test_nccl_at_world_size_one(launch: Callable[[str], World]) -> None:
    """torchrun --nproc-per-node=1 on one GPU: the agreed backend is nccl;
    a CUDA all-reduce runs over it and the trainer trains as one plain process does."""
    world = launch("nccl-1")
    (nccl,) = world.case("nccl")
    assert nccl["group_backend"] == "nccl"
    assert nccl["default_backend"] == "cpu:gloo,cuda:nccl"
    assert nccl["all_reduce"] == [1.0, 1.0, 1.0] and nccl["current_device"] == 0
    (runs,) = world.case("train")
    one = launch("cuda-1").case("train")[0]
    for run in RUNS:
        assert runs[run]["group_backend"] == "nccl" and runs[run]["device"] == "cuda:0"
        assert_close(runs[run]["final"], one[run]["final"], EQUIVALENT, run)


@pytest.mark.gpu(2)
def test_two_gpus_over_nccl(launch: Callable[[str], World]) -> None:
    """device="auto" on 2 GPUs: rank r on cuda:r, nccl; equal to one process."""
    world = launch("nccl-2")
    for rank, runs in enumerate(world.case("train")):
        assert {runs[run]["group_backend"] for run in RUNS} == {"nccl"}
        assert {runs[run]["device"] for run in RUNS} == {f"cuda:{rank}"}
    check_trained_alike(world, launch("cuda-1"), ["cuda:0", "cuda:1"])


@pytest.mark.gpu(2)
def test_two_gpus_resume_bit_exact(launch: Callable[[str], World]) -> None:
    check_resume(launch("nccl-2"))


@pytest.mark.gpu(2)
def test_two_ranks_share_cuda0_while_two_gpus_are_visible(
    launch: Callable[[str], World],
) -> None:
    world = launch("shared-2-of-2")
    for runs in world.case("train"):
        assert {runs[run]["group_backend"] for run in RUNS} == {"gloo"}
    check_trained_alike(world, launch("cuda-1"), ["cuda:0", "cuda:0"])


@pytest.mark.gpu(2)
@pytest.mark.parametrize(
    "name, devices", [("local-rank-2", ["cuda:0", "cuda:1"]), ("own-gpu-2", ["cuda:0", "cuda:0"])]
)
def test_a_gpu_of_each_ranks_own_gets_nccl(
    name: str, devices: list[str], launch: Callable[[str], World]
) -> None:
    """device=f"cuda:{LOCAL_RANK}" (was gloo), and one visible GPU per process (was refused):
    every rank has a GPU of its own, so the ranks agree on nccl."""
    world = launch(name)
    for rank, runs in enumerate(world.case("train")):
        assert {runs[run]["group_backend"] for run in RUNS} == {"nccl"}
        assert {runs[run]["device"] for run in RUNS} == {devices[rank]}
    check_trained_alike(world, launch("cuda-1"), devices)
