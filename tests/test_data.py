"""Training data in real worlds: token-budget batches and mid-epoch resume, 1 and 2 ranks.

The any-size map-style cases (323, 331, 289, 203 samples) live in tests/test_trainer.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_ranks
from torch.utils.data import DataLoader, Sampler
from workers.trainer_worker import SampleIds, make_trainer

from fastdist.data import TokenBatchSampler
from fastdist.data.workers import fork_may_hang, worker_context

WORKER = Path(__file__).resolve().parent / "workers" / "data_worker.py"
N_SEQ, MAX_TOKENS = 203, 24  # the worker's sequences and token budget


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, Any]]]:
    """Every rank's results of a world of 1 (plain process) or 2 (torchrun), run once."""
    runs: dict[int, list[dict[str, Any]]] = {}

    def get(size: int) -> list[dict[str, Any]]:
        if size not in runs:
            out, cwd = tmp_path_factory.mktemp(f"data-{size}"), tmp_path_factory.mktemp("cwd")
            _, runs[size] = run_ranks(WORKER, size, [str(out)], out, size > 1, cwd=cwd, timeout=240)
        return runs[size]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["sum-count", "sample-mean"])
def test_token_batches_two_ranks_equal_one_process(loss: str, worlds: Any) -> None:
    """1 x update_every 4 == 2 x update_every 2 on the same token batches, to 1e-5."""
    one = worlds(1)[0]["token"][loss]
    for rank, data in enumerate(worlds(2)):
        got = data["token"][loss]
        assert got["steps"] == one["steps"]
        diff = (torch.tensor(got["final"]) - torch.tensor(one["final"])).abs().max().item()
        assert diff < 1e-5, f"rank {rank}: max difference {diff:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
def test_token_batches_cover_every_sample_once_within_budget(size: int, worlds: Any) -> None:
    ranks = worlds(size)
    for epoch in range(2):
        seen = [i for data in ranks for i in data["token"]["sum-count"]["ids"][epoch]]
        assert sorted(seen) == list(range(N_SEQ)), f"epoch {epoch}"
    padded = [s for data in ranks for s in data["token"]["sum-count"]["padded"]]
    assert max(padded) <= MAX_TOKENS and min(padded) < MAX_TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("kind", ["map", "token"])
def test_mid_epoch_resume_is_bit_exact(size: int, kind: str, worlds: Any) -> None:
    """Stopped at update 5, resumed from the checkpoint of update 3 (mid-epoch 1)."""
    for data in worlds(size):
        run = data["resume"][kind]
        assert (run["stopped_at"], run["resumed_at"]) == (5, 3)
        assert run["resumed"] == run["straight"]


def test_token_batches_do_not_depend_on_the_world_size() -> None:
    lengths = torch.randint(1, 40, (301,), generator=torch.Generator().manual_seed(1)).tolist()
    one = TokenBatchSampler(lengths, 64, rank=0, world_size=1)
    two = [TokenBatchSampler(lengths, 64, rank=r, world_size=2) for r in range(2)]
    for sampler in (one, *two):
        sampler.set_epoch(3)
    batches = list(one)
    assert [list(s) for s in two] == [batches[0::2], batches[1::2]]
    assert batches != one.batches(4), "a new order every epoch"
    two[1].set_start(5)  # resumed after 5 global batches
    assert list(two[1]) == batches[5:][1::2]


def test_token_sampler_names_a_sample_over_budget() -> None:
    with pytest.raises(ValueError, match=r"sample 2 has length 70 > max_tokens=64"):
        TokenBatchSampler([3, 5, 70, 1], 64)


@pytest.mark.parametrize(
    "version, hangs",
    [((3, 11, 7), True), ((3, 11, 10), False), ((3, 10, 14), True), ((3, 12, 0), False)],
)
def test_fork_may_hang_on_pythons_before_the_cpython_fix(
    version: tuple[int, int, int], hangs: bool
) -> None:
    assert fork_may_hang(version) is hangs  # CPython gh-112275


def test_forkserver_workers_start_and_read_every_item() -> None:
    """The opt-in start method for forked-worker hangs reads the data like a fork does."""
    data = list(range(10))
    loader = DataLoader(
        data, batch_size=3, num_workers=2, multiprocessing_context=worker_context("forkserver")
    )
    assert sorted(i for batch in loader for i in batch.tolist()) == data


class EveryOther(Sampler[int]):
    """A user's sampler: the even indices of 20 samples, in order."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(0, 20, 2))

    def __len__(self) -> int:
        return 10


def test_a_user_sampler_with_drop_last_drops_the_short_batch(no_dist_env: None) -> None:
    """10 sampled indices in batches of 4 with drop_last: 2 updates of 4 samples, the last 2
    samples dropped (the short batch was trained again at full weight: 3 updates)."""
    ids = SampleIds()
    trainer = make_trainer(
        20, sampler=EveryOther(), drop_last=True, batch_size_per_gpu=4, callbacks_all=[ids]
    )
    assert trainer.train()["steps"] == 2
    assert ids.epochs == [[0, 2, 4, 6, 8, 10, 12, 14]]
