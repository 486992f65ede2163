"""FSDP with tensor parallelism (``FSDP(tp=2, tp_plan=...)``) against DDP, in three launches.

tests/workers/tp_worker.py, on 4 ranks: three bad setups (each must fail alike on every rank
before the mesh exists), then a 2x2 mesh (dp_shard x tp) trained four times: killed at update 3
and resumed by torchrun (max_restarts=1; first, so that the restart retrains only it), plainly,
with activation checkpointing and with amp="bf16". On 2 ranks: DDP, tp=2 alone (one data
shard, twice the batch: the same global batch), a tiny Hugging Face Llama under its own plan
and under DDP, FSDP compiled block by block and the 2x2 run's last checkpoint resumed on FSDP.
On one process: that checkpoint on the plain model. Every run: AdamW, update_every=2, gradient
clipping by global norm (the Llama: none). The 4- and 2-rank worlds also train a wider model
to hold fastdist.estimate_memory to the peak memory measured. The long tier compiles the 2x2
mesh block by block, in a 4-rank launch of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_python, run_torchrun
from workers.fsdp_worker import BlockNet

WORKER = Path(__file__).resolve().parent / "workers" / "tp_worker.py"

pytestmark = pytest.mark.slow

#: Every allocation above 64 KiB its own mapping: freed tensors leave the resident memory at
#: once, so that its high-water mark follows the live tensors (the estimate's measured peak).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# Each launch compiles afresh: compiled code cached on disk by an earlier launch names the
# process groups as that launch numbered them.


def read(out: Path, mode: str, size: int) -> list[dict[str, Any]]:
    paths = [out / mode / f"rank{rank}.json" for rank in range(size)]
    return [json.loads(p.read_text()) for p in paths]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def four(out: Path) -> list[dict[str, Any]]:
    env = {**MALLOC, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor-four")}
    result = run_torchrun(
        WORKER, 4, ["four", str(out)], timeout=240, cwd=out, max_restarts=1, env=env
    )
    assert "resumed from" in result.output and "step 3" in result.output, result.describe()
    return read(out, "four", 4)


@pytest.fixture(scope="module")
def two(out: Path, four: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = {**MALLOC, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor-two")}
    run_torchrun(WORKER, 2, ["two", str(out)], timeout=180, cwd=out, env=env)
    return read(out, "two", 2)


@pytest.fixture(scope="module")
def one(out: Path, four: list[dict[str, Any]]) -> dict[str, Any]:
    run_python(WORKER, ["one", str(out)], timeout=120, cwd=out)
    return read(out, "one", 1)[0]


def params(run: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(run["params"])


def test_tp_alone_and_2x2_equal_ddp(four: list[dict[str, Any]], two: list[dict[str, Any]]) -> None:
    ddp = params(two[0]["ddp"])
    initial = torch.cat([p.detach().flatten() for p in BlockNet().parameters()])
    assert (ddp - initial).abs().max() > 1e-3  # it trained
    for run in (two[0]["tp"], four[0]["mesh"]):
        assert run["steps"] == two[0]["ddp"]["steps"] == 6
        torch.testing.assert_close(params(run), ddp, rtol=0, atol=1e-5)


def test_hugging_face_model_with_its_own_plan_equals_ddp(two: list[dict[str, Any]]) -> None:
    hf = two[0]["hf"]
    if hf["ddp"] is None:
        pytest.skip("transformers is not installed")
    torch.testing.assert_close(torch.tensor(hf["tp"]), torch.tensor(hf["ddp"]), rtol=0, atol=1e-5)


def test_evaluate_and_predict_equal_ddp(
    four: list[dict[str, Any]], two: list[dict[str, Any]]
) -> None:
    reference = two[0]["ddp"]
    for rank in [*two, *four]:
        for name in ("tp", "mesh"):
            run = rank.get(name)
            if run is None:
                continue
            assert run["eval"]["acc"] == reference["eval"]["acc"]
            assert run["eval"]["loss"] == pytest.approx(reference["eval"]["loss"], abs=1e-6)
    for run in (two[0]["tp"], four[0]["mesh"]):  # rank 0 gathers all 13 outputs
        predicted = torch.tensor(run["predict"])
        assert predicted.shape == (13, 3)
        torch.testing.assert_close(predicted, torch.tensor(reference["predict"]))
    assert all(rank["mesh"]["predict"] is None for rank in four[1:])


def test_activation_checkpointing_on_2x2_keeps_the_parameters(
    four: list[dict[str, Any]],
) -> None:
    mesh, checkpointed = four[0]["mesh"], four[0]["checkpointed"]
    torch.testing.assert_close(params(checkpointed), params(mesh), rtol=0, atol=1e-6)


def test_compile_per_block_under_fsdp(
    four: list[dict[str, Any]], two: list[dict[str, Any]]
) -> None:
    compiled = two[0]["compiled"]
    assert compiled["compiled"] == ["blocks.0", "blocks.1"]  # each block, not the root
    torch.testing.assert_close(params(compiled), params(two[0]["ddp"]), rtol=0, atol=1e-5)
    assert four[0]["mesh"]["compiled"] == []


@pytest.mark.long  # 4 ranks compiling on 2 cores: 34 s of CI
def test_compile_per_block_on_2x2(out: Path) -> None:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(out / "inductor-compiled")}
    run_torchrun(WORKER, 4, ["compiled", str(out)], timeout=300, cwd=out, env=env)
    runs = read(out, "compiled", 4)
    compiled, mesh = runs[0]["compiled"], runs[0]["mesh"]
    assert compiled["compiled"] == ["blocks.0", "blocks.1"] and mesh["compiled"] == []
    torch.testing.assert_close(params(compiled), params(mesh), rtol=0, atol=1e-5)


def test_bf16_on_2x2_trains(four: list[dict[str, Any]]) -> None:
    losses = torch.tensor(four[0]["bf16"]["losses"])
    assert len(losses) == 10 and bool(torch.isfinite(losses).all())
    assert losses[-3:].sum() < losses[:3].sum()
    torch.testing.assert_close(params(four[0]["bf16"]), params(four[0]["mesh"]), rtol=0, atol=0.05)


def test_bad_input_fails_alike_on_every_rank_before_the_mesh(four: list[dict[str, Any]]) -> None:
    errors = four[0]["bad_input"]
    assert all(rank["bad_input"] == errors for rank in four)
    assert errors["meshes_made"] == "0"  # raised before init_device_mesh's collectives
    assert "FSDP(tp=3)" in errors["tp_not_dividing"] and "world has 4" in errors["tp_not_dividing"]
    assert "'blocks.9'" in errors["missing_module"]
    assert "model.named_modules()" in errors["missing_module"]
    assert "out (Linear)" in errors["indivisible"] and "(3)" in errors["indivisible"]
    assert "choose a tp that divides 3" in errors["indivisible"]


def test_a_column_split_output_layer_is_refused(two: list[dict[str, Any]]) -> None:
    # Each rank's output would be half the model's, broadcast against the target by the loss.
    head = two[0]["colwise_head"]
    assert {rank["colwise_head"] for rank in two} == {head}
    assert (
        "BlockNet gives outputs of shapes [(8, 1)] where one process's model gives [(8, 2)]" in head
    )
    assert "(out)" in head and "output_layouts=Replicate()" in head


def test_2x2_resumes_bit_identically(four: list[dict[str, Any]]) -> None:
    killed, uninterrupted = four[0]["killed"], four[0]["mesh"]
    assert killed["steps"] == 6
    assert torch.equal(params(killed), params(uninterrupted))


def test_2x2_checkpoint_reshards_onto_fsdp_and_one_process(
    four: list[dict[str, Any]], two: list[dict[str, Any]], one: dict[str, Any]
) -> None:
    final = params(four[0]["killed"])
    for run in (two[0]["resharded"], one["resharded"]):
        assert run["steps"] == 6  # nothing left to train: the checkpoint's weights as they are
        assert torch.equal(params(run), final)


def test_best_model_is_a_full_state_dict(four: list[dict[str, Any]]) -> None:
    # The worker loaded the file (torch.load, weights_only) into a plain BlockNet, strictly.
    best = four[0]["killed"]["best"]
    assert best is not None and len(best) == len(four[0]["killed"]["params"])


@pytest.mark.parametrize(("mode", "strategy"), [("two", "ddp"), ("two", "fsdp"), ("four", "2d")])
def test_memory_estimate_within_15_percent_of_measured_peak(
    four: list[dict[str, Any]], two: list[dict[str, Any]], mode: str, strategy: str
) -> None:
    for rank in four if mode == "four" else two:
        found = rank["estimate"][strategy]
        assert 0.85 <= found["measured"] / found["peak"] <= 1.15, found
