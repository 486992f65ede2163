"""strategy="fsdp" (torch's fully_shard) against strategy="ddp" in one 2-rank gloo launch.

tests/workers/fsdp_worker.py trains the same model both ways (update_every=2, gradient
clipping, AdamW), evaluates and predicts an odd-size dev set (7 and 6 samples per rank, so the
ranks have 4 and 3 batches: FSDP pads with forwards whose outputs are dropped), keeps the best
model, and trains once more with amp="bf16".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from inprocess import make_trainer
from launch import run_torchrun
from workers.fsdp_worker import BlockNet

from fastdist import Callback

WORKER = Path(__file__).resolve().parent / "workers" / "fsdp_worker.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp")
    result = run_torchrun(WORKER, 2, [str(out)], timeout=180, cwd=out)
    paths = [out / f"rank{rank}.json" for rank in range(2)]
    assert all(p.exists() for p in paths), result.describe()
    assert "fsdp: sharded 2 block(s) one by one (blocks.0 ... blocks.1)" in result.output
    return [json.loads(p.read_text()) for p in paths]


def test_fsdp_reaches_ddp_parameters(ranks: list[dict[str, Any]]) -> None:
    ddp, fsdp = (torch.tensor(ranks[0][s]["params"]) for s in ("ddp", "fsdp"))
    initial = torch.cat([p.detach().flatten() for p in BlockNet().parameters()])
    assert (ddp - initial).abs().max() > 1e-3  # it trained
    torch.testing.assert_close(fsdp, ddp, rtol=0, atol=1e-5)


def test_optimizer_kept_its_class_and_hyperparameters(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["fsdp"]["optimizer_class"] == "AdamW"
        assert rank["fsdp"]["weight_decay"] == 0.1


def test_each_rank_holds_about_half(ranks: list[dict[str, Any]]) -> None:
    for what in ("params_local_total", "optim_local_total"):
        locals_ = [rank["fsdp"][what][0] for rank in ranks]
        total = ranks[0]["fsdp"][what][1]
        assert sum(locals_) == total, what  # every element on exactly one rank
        assert all(0.45 * total <= n <= 0.55 * total for n in locals_), (what, locals_, total)
        assert [rank["ddp"][what][0] for rank in ranks] == [total, total]


def test_eval_and_predict_equal_one_process(ranks: list[dict[str, Any]]) -> None:
    one = ranks[0]["fsdp"]
    for rank in ranks:
        assert rank["fsdp"]["eval"] == rank["ddp"]["eval"] == ranks[0]["fsdp"]["eval"]
    assert one["eval"]["acc"] == one["eval_one_process"]["acc"]
    assert one["eval"]["loss"] == pytest.approx(one["eval_one_process"]["loss"], abs=1e-6)
    predicted = torch.tensor(one["predict"])
    assert predicted.shape == (13, 3)
    torch.testing.assert_close(predicted, torch.tensor(one["predict_one_process"]))
    assert ranks[1]["fsdp"]["predict"] is None


def test_best_model_is_a_plain_state_dict(ranks: list[dict[str, Any]]) -> None:
    # The worker loaded the file into a fresh BlockNet (strict) with torch.load(weights_only).
    assert ranks[0]["fsdp"]["best_equals_final"]  # load_best_model: the final weights are it


def test_bf16_trains(ranks: list[dict[str, Any]]) -> None:
    losses = ranks[0]["bf16"]["losses"]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    assert ranks[0]["bf16"]["param_dtype"] == "torch.float32"  # the sharded master weights


def test_blocks_reshard_after_forward_and_the_root_does_not(ranks: list[dict[str, Any]]) -> None:
    """Between forward and backward a block's parameters are sharded again (memory), the
    root's stay gathered: backward needs them first, and resharding them would cost one more
    all-gather per micro-batch."""
    for data in ranks:
        assert data["bf16"]["sharded_in_backward"] == {"inp.weight": False, "blocks.0.weight": True}


def test_an_optimizer_that_never_stepped_is_saved_and_resumed_so(ranks: list[dict]) -> None:
    """Epoch 1's updates all skipped (non-finite losses), so its checkpoint holds an
    optimizer that never stepped, which torch's get_optimizer_state_dict makes a state for
    by stepping it at learning rate 0: one step more for AdamW's bias correction. Neither
    the run that wrote it nor the one resumed from it keeps that step: after epoch 2's 3
    updates AdamW counts 3, and the parameters are DDP's."""
    assert ranks[0]["skipped_fsdp"]["epochs"] == [1, 2]
    assert ranks[0]["resumed"]["epochs"] == [2]  # resumed from epoch 1's checkpoint
    for rank in ranks:
        for run in ("skipped_ddp", "skipped_fsdp", "resumed"):
            assert rank[run]["steps"] == [3.0], run
    ddp = torch.tensor(ranks[0]["skipped_ddp"]["params"])
    for run in ("skipped_fsdp", "resumed"):
        torch.testing.assert_close(torch.tensor(ranks[0][run]["params"]), ddp, rtol=0, atol=1e-5)


def test_one_process_runs_the_plain_model() -> None:
    trainer = make_trainer(Callback(), strategy="fsdp")
    assert type(trainer.strategy.module).__name__ == "Linear"  # no FSDP wrapper
    assert trainer.train()["steps"] == 6
