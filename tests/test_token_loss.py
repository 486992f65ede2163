"""A ``(sum, count)`` loss normalises each update by its global count (the translation case)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_python, run_torchrun
from torch.utils.data import default_collate
from workers.token_loss_worker import Sequences, Tagger, token_loss

import fastdist

WORKER = Path(__file__).resolve().parent / "workers" / "token_loss_worker.py"


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Final parameters of 1 process x batch 4 x update_every 4, launched once for both tests."""
    out = tmp_path_factory.mktemp("one") / "one.json"
    run_python(WORKER, args=[str(out), "4"])
    return out


@pytest.mark.slow
def test_two_ranks_reach_the_one_process_parameters(one: Path, tmp_path: Path) -> None:
    two = tmp_path / "two.json"
    run_torchrun(WORKER, nproc=2, args=[str(two), "2"])  # 2 processes x batch 4 x 2
    expected, got = (torch.tensor(json.loads(p.read_text())) for p in (one, two))
    assert torch.allclose(got, expected, rtol=0, atol=1e-12), (got - expected).abs().max()


@pytest.mark.slow
def test_one_process_equals_a_hand_written_token_average(one: Path) -> None:
    """Each update's gradient is the total token loss over the total token count."""
    fastdist.set_seed(0)
    model, data = Tagger(), Sequences()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in (1, 2):  # the trainer's order: randperm seeded with seed + epoch
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(data), 16):  # one update: 4 micro-batches of 4
            batch = default_collate([data[int(i)] for i in order[start : start + 16]])
            total, count = token_loss(model(batch["x"]), batch)
            optimizer.zero_grad()
            (total / count).backward()
            optimizer.step()
    expected = torch.cat([p.detach().flatten() for p in model.parameters()])
    got = torch.tensor(json.loads(one.read_text()), dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=0, atol=1e-12), (got - expected).abs().max()
    lengths = data.lengths  # and micro-batches really differ in token counts
    assert len({sum(lengths[i : i + 4]) for i in range(0, len(lengths), 4)}) > 1
