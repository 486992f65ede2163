"""Mixed precision, DDP communication hooks, model averaging and DDP knobs, on 2 real ranks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from launch import run_torchrun
from torch import nn
from torch.utils.data import TensorDataset

from fastdist import DDP, DistTrainer
from fastdist.trainer.precision import Precision

WORKER = Path(__file__).resolve().parent / "workers" / "options_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("options")
    run_torchrun(WORKER, nproc=2, args=[str(out)], timeout=240)
    return json.loads((out / "options.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", ["fp32", "bf16", "hook_fp16", "hook_powersgd", "average_every_4", "ddp_knobs"]
)
def test_every_option_trains_the_task(results: dict, variant: str) -> None:
    assert results[variant]["acc"] > 0.95  # a linearly separable task; chance is 0.5


@pytest.mark.slow
def test_bf16_matches_fp32_loosely(results: dict) -> None:
    fp32, bf16 = (torch.tensor(results[v]["params"]) for v in ("fp32", "bf16"))
    assert not torch.equal(fp32, bf16)  # autocast really ran in bf16
    assert torch.allclose(fp32, bf16, atol=0.1), (fp32 - bf16).abs().max()
    assert abs(results["fp32"]["acc"] - results["bf16"]["acc"]) < 0.02


@pytest.mark.slow
def test_ddp_knobs_do_not_change_the_result(results: dict) -> None:
    assert results["ddp_knobs"]["params"] == results["fp32"]["params"]


def test_fp16_needs_cuda() -> None:
    with pytest.raises(ValueError, match="amp='fp16' needs a CUDA device"):
        Precision("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="amp must be None, 'bf16' or 'fp16'"):
        Precision("int8", torch.device("cpu"))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"comm_hook": "gzip"}, r"comm_hook must be one of None, 'fp16', 'bf16', 'powersgd'"),
        ({"comm_hook": "fp16", "average_every": 2}, "choose one"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb must be a number > 0"),
        ({"average_every": -1}, "average_every must be an integer >= 0"),
    ],
)
def test_bad_strategy_options_are_refused_when_built(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DDP(**options)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"strategy": DDP(comm_hook="bf16")}, "comm_hook='bf16' needs CUDA and NCCL"),
        (
            {"on_nonfinite": "skip", "strategy": DDP(average_every=2)},
            "on_nonfinite='skip' needs the grad",
        ),
        ({"fp16": True}, "amp='fp16' needs a CUDA device"),
    ],
)
def test_bad_options_are_refused(options: dict, message: str, no_dist_env: None) -> None:
    model = nn.Linear(2, 1)
    data = TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
    with pytest.raises(ValueError, match=message):
        DistTrainer(data, model, loss=nn.MSELoss(), **{"device": "cpu", **options})


@pytest.mark.parametrize(
    "flat, home",
    [
        ({"bucket_cap_mb": 50}, "strategy=DDP(bucket_cap_mb=50)"),
        ({"find_unused_parameters": True}, "strategy=DDP(find_unused_parameters=True)"),
        ({"ddp_comm_hook": "powersgd"}, "strategy=DDP(comm_hook='powersgd')"),
        ({"average_every": 4}, "strategy=DDP(average_every=4)"),
        ({"reshard_after_forward": False}, "strategy=FSDP(reshard_after_forward=False)"),
    ],
)
def test_a_flat_strategy_keyword_names_its_new_home(
    flat: dict, home: str, no_dist_env: None
) -> None:
    model = nn.Linear(2, 1)
    data = TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
    with pytest.raises(TypeError, match=re.escape(home)):
        DistTrainer(data, model, loss=nn.MSELoss(), device="cpu", **flat)


def test_an_unknown_keyword_suggests_the_name_meant(no_dist_env: None) -> None:
    model = nn.Linear(2, 1)
    data = TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
    with pytest.raises(TypeError, match="'batch_size'; did you mean batch_size_per_gpu"):
        DistTrainer(data, model, loss=nn.MSELoss(), device="cpu", batch_size=4)
