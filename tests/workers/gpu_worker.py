"""Worker for tests/test_gpu_multi.py: train tiny float64 models on CUDA in a real world.

Usage (under torchrun or as a plain process, with CUDA visible)::

    gpu_worker.py DEVICE CASE[,CASE...] OUT_DIR

``DEVICE`` is the trainer's ``device=`` (``auto``: ``cuda:LOCAL_RANK``; ``cuda:0``: every
rank on GPU 0; ``cuda:LOCAL_RANK``: the spelling most DDP scripts use, expanded here;
``auto-own-gpu``: ``auto`` in a process shown only its own GPU, as a scheduler setting
``CUDA_VISIBLE_DEVICES`` per rank does). Runs the cases in order in one process (group) and writes
``{"meta": ..., CASE: result, ...}`` to ``OUT_DIR/rank<R>.json``. The models and data are
tests/workers/trainer_worker.py's (equivalence) and resume_worker.py's (dropout, so a resume
must restore the CUDA generator).
"""

from __future__ import annotations

import os
import sys

from workers.ending import exit_now

if len(sys.argv) > 1 and sys.argv[1] == "auto-own-gpu":  # before CUDA starts: see the docstring
    _visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0,1").split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _visible[int(os.environ.get("LOCAL_RANK", "0"))]
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from workers.resume_worker import DropNet
from workers.trainer_worker import ToyData, ToyNet, flat_params, write_json

from fastdist import AccuracyMetric, CrossEntropyLoss, DistTrainer
from fastdist.distributed import get_rank, get_world_size, init_distributed
from fastdist.distributed.env import default_backend
from fastdist.trainer.arguments import resolve_device

TIMEOUT = 120  # seconds any collective may wait: a broken GPU setup fails, never hangs
RESUME_FROM = 4  # the resumed run starts from this update's checkpoint (inside epoch 1)


def make_trainer(
    device: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int, **kwargs: Any
) -> DistTrainer:
    """A quiet trainer on ``ToyData(n)`` and ``device``; its global batch does not depend on
    the world size (8 per rank x update_every ``4 // world``), so worlds are comparable."""
    options: dict[str, Any] = {
        "loss": CrossEntropyLoss(),
        "batch_size_per_gpu": 8,
        "update_every": 4 // get_world_size(),
        "n_epochs": 2,
        "print_every": 3,
        "use_tqdm": False,
        "device": device,
        "timeout": TIMEOUT,
        "load_best_model": False,
    }
    options.update(kwargs)
    return DistTrainer(ToyData(n), model, optimizer, **options)


def param_devices(model: torch.nn.Module) -> list[str]:
    return sorted({str(p.device) for p in model.parameters()})


def case_nccl(device: str, out: Path) -> dict[str, Any]:
    """Form the group as a user would at world size 1 (DistTrainer forms none there), the
    backend agreed from the resolved device, and all-reduce a CUDA tensor over it."""
    resolved = resolve_device(device)
    init_distributed(timeout=TIMEOUT, device=resolved, exclusive=True)
    tensor = torch.full((3,), float(get_rank() + 1), device=resolved)
    dist.all_reduce(tensor)
    dist.barrier()
    return {
        "default_backend": default_backend(),
        "group_backend": dist.get_backend(),
        "all_reduce": tensor.tolist(),
        "current_device": torch.cuda.current_device(),
    }


def case_train(device: str, out: Path) -> dict[str, Any]:
    """SGD and AdamW runs with per-epoch evaluation and cross-rank parameter checks.

    128 samples: 4 full updates per epoch. 56: windows of 32 and 24 samples (a short end).
    """
    results: dict[str, Any] = {}
    for opt, n in (("sgd", 128), ("adamw", 56)):
        model = ToyNet(seed=1)
        init = flat_params(model)
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        if opt == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        trainer = make_trainer(
            device,
            model,
            optimizer,
            n,
            dev_data=ToyData(101, seed=7),
            metrics=AccuracyMetric(),
            check_sync_every=2,  # a cross-rank checksum over the real backend, every 2 updates
        )
        result = trainer.train()
        results[f"{opt}-{n}"] = {
            "init": init,
            "final": flat_params(model),
            "steps": result["steps"],
            "best_eval": result["best_eval"],
            "device": str(trainer.device),
            "param_devices": param_devices(model),
            "group_backend": dist.get_backend() if dist.is_initialized() else None,
        }
    return results


def case_resume(device: str, out: Path) -> dict[str, Any]:
    """Train straight through with a checkpoint every update; train again from the
    checkpoint of update ``RESUME_FROM``. Dropout makes the CUDA generator part of the state.

    72 samples, 2 epochs: 9 updates per epoch on any world size.
    """
    runs: dict[str, Any] = {}
    for name in ("straight", "resumed"):
        torch.manual_seed(1234)  # the model's init and the first dropout masks (CPU and CUDA)
        model = DropNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        trainer = make_trainer(
            device,
            model,
            optimizer,
            72,
            batch_size_per_gpu=4,
            update_every=2 // get_world_size(),
            checkpoint_every=1,
            keep_checkpoints=20,
            save_path=str(out / f"resume-{name}"),
        )
        resume: str | bool = False
        if name == "resumed":  # rank 0 wrote it; every rank reads it from the shared disk
            resume = str(out / "resume-straight" / "checkpoints" / f"step-{RESUME_FROM:08d}.pt")
        result = trainer.train(resume=resume)
        runs[name] = {
            "final": flat_params(model),
            "steps": result["steps"],
            "param_devices": param_devices(model),
        }
    return runs


CASES: dict[str, Callable[[str, Path], dict[str, Any]]] = {
    "nccl": case_nccl,
    "train": case_train,
    "resume": case_resume,
}


def main(argv: list[str]) -> int:
    if len(argv) != 4 or not set(argv[2].split(",")) <= CASES.keys():
        print(f"usage: {argv[0]} DEVICE CASE[,CASE...] OUT_DIR; cases: {', '.join(CASES)}")
        return 2
    device, out = argv[1], Path(argv[3])
    device = {
        "cuda:LOCAL_RANK": f"cuda:{os.environ.get('LOCAL_RANK', '0')}",
        "auto-own-gpu": "auto",
    }.get(device, device)
    results: dict[str, Any] = {
        "meta": {
            "rank": get_rank(),
            "world_size": get_world_size(),
            "visible_gpus": torch.cuda.device_count(),
        }
    }
    for case in argv[2].split(","):
        results[case] = CASES[case](device, out)
    write_json(out, results)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
