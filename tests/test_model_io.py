"""A sequence of trainers in one process, and save_model/predict called on rank 0 only.

tests/workers/model_io_worker.py runs the worlds; the Hugging Face save idiom is tested in
tests/test_hf.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from launch import run_torchrun

WORKER = Path(__file__).resolve().parent / "workers" / "model_io_worker.py"


def launch(mode: str, nproc: int, out: Path, timeout: float) -> list[dict[str, Any]]:
    result = run_torchrun(WORKER, nproc, [mode, str(out)], timeout=timeout, cwd=out)
    paths = [out / f"rank{rank}.json" for rank in range(nproc)]
    assert all(p.exists() for p in paths), result.describe()
    return [json.loads(p.read_text()) for p in paths]


@pytest.mark.slow
def test_trainers_one_after_another_in_one_process(tmp_path: Path) -> None:
    """Each trainer tears down its process group; FSDP's meshes must not be built on it (a
    later trainer's DTensors reached the torn-down group through torch's caches)."""
    result = launch("trainers", 4, tmp_path, timeout=400)[0]
    rank0 = result["sequence"]
    errors = {name: run["error"] for name, run in rank0.items() if "error" in run}
    assert errors == {}
    assert [run["steps"] for run in rank0.values()] == [4] * 6
    assert rank0["fsdp_again"] == rank0["fsdp"]  # the same training, bit for bit
    assert rank0["ddp_again"] == rank0["ddp"]
    for name in ("fsdp", "compiled", "2d"):
        assert rank0[name]["params"] == pytest.approx(rank0["ddp"]["params"], abs=1e-5), name
    # A model an FSDP trainer sharded, given to another: a clear error before any collective.
    assert result["reused"] == (
        "model (FSDPBlockNet) was sharded by an earlier trainer (its parameters are DTensors), "
        "and a model is wrapped once: build the model anew for this trainer, and load the "
        "weights the first one saved (trainer.save_model) if it goes on from them"
    )


@pytest.mark.slow
def test_save_model_and_predict_on_rank_zero_only_raise_naming_the_cause(
    tmp_path: Path,
) -> None:
    rank0, rank1 = launch("rank0", 2, tmp_path, timeout=120)
    assert rank1 == {}
    busy = rank0["busy"]  # rank 1 was asleep: the entry wait ran out (timeout=5)
    assert busy["error"].startswith("RuntimeError: save_model must be called on every rank, ")
    assert "(5 s passed; rank 1: epoch 2, step 6, phase finished): call it" in busy["error"]
    assert 5 <= busy["seconds"] < 6
    busy_predict = rank0["busy_predict"]  # the group's timeout, not torch's 30 minutes
    assert busy_predict["error"].startswith("RuntimeError: predict must be called on every rank")
    assert "(5 s passed; rank 1: " in busy_predict["error"]
    assert 5 <= busy_predict["seconds"] < 6
    for call, name in [
        ("ended", "save_model"), ("predict", "predict"), ("evaluate", "evaluate"),
        ("barrier", "fastdist.barrier"),  # passed, paired with the barrier of rank 1's exit
    ]:  # fmt: skip
        error = rank0[call]["error"]  # rank 1's script ended: no wait for the timeout
        assert error.startswith(f"RuntimeError: {name} must be called on every rank, "), call
        assert "ranks [1] did not call it (ranks [1] ended their script" in error, call
        assert "call it on every rank, not under `if rank == 0`" in error
    assert rank0["ended"]["seconds"] < 4  # rank 1 ended 2 s after the first error
    assert rank0["predict"]["seconds"] < 1 and rank0["evaluate"]["seconds"] < 1
    assert rank0["fastdist.predict"]["error"] == rank0["predict"]["error"]
    assert not list(tmp_path.glob("*.pt"))  # nothing written
