"""Streaming training data (``IterableDataset``) in real worlds of 1 and 2 ranks, and in-process
checks of what a stream refuses."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import Result, run_ranks
from torch.utils.data import DataLoader, IterableDataset

from fastdist import Callback, DistTrainer
from fastdist.callbacks import WarmupCallback
from fastdist.data import ShardedStream, StreamShard
from fastdist.trainer.progress import Progress

WORKER = Path(__file__).resolve().parent / "workers" / "stream_worker.py"
N_ITEMS = 103  # the worker's stream
EVERY_ITEM = list(range(N_ITEMS))


@pytest.fixture(scope="module")
def worlds(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[int], tuple[Result, list[dict[str, Any]]]]:
    """The launch and every rank's results of a world of 1 (plain process) or 2, run once."""
    runs: dict[int, tuple[Result, list[dict[str, Any]]]] = {}

    def get(size: int) -> tuple[Result, list[dict[str, Any]]]:
        if size not in runs:
            out, cwd = tmp_path_factory.mktemp(f"stream-{size}"), tmp_path_factory.mktemp("cwd")
            runs[size] = run_ranks(WORKER, size, [str(out)], out, size > 1, cwd=cwd, timeout=240)
        return runs[size]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("workers", ["0", "2"])
def test_every_item_once_per_epoch(size: int, workers: str, worlds: Any) -> None:
    """Sharded by rank x DataLoader worker: the ranks' items of an epoch are the stream, once."""
    _, ranks = worlds(size)
    runs = [data["coverage"][workers] for data in ranks]
    for epoch in range(2):
        seen = sorted(i for run in runs for i in run["ids"][epoch])
        assert seen == EVERY_ITEM, f"epoch {epoch}"
    # 103 items in batches of 3 and windows of 2: 18 updates per epoch on one rank; on two,
    # rank 0's 52 items make 18 batches and rank 1's 51 make 17: 9 updates, 1 filler.
    assert {run["steps"] for run in runs} == {36 if size == 1 else 18}
    assert all(run["total_steps"] is None and run["best_eval"] is not None for run in runs)
    assert all(run["final"] == runs[0]["final"] for run in runs), "ranks out of sync"


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
def test_a_stream_that_shards_itself_is_read_as_it_is(size: int, worlds: Any) -> None:
    """ShardedStream: each reader's own contiguous range, not split again: all items once."""
    _, ranks = worlds(size)
    for epoch in range(2):
        seen = sorted(i for data in ranks for i in data["sharded"]["ids"][epoch])
        assert seen == EVERY_ITEM, f"epoch {epoch}"


@pytest.mark.slow
def test_uneven_stream_ends_together_without_hanging(worlds: Any) -> None:
    """Rank 1's stream holds 40 items, rank 0's 103: rank 1 fills until rank 0's part ends,
    under DDP and under FSDP (whose every forward is a collective)."""
    _, ranks = worlds(2)
    for strategy in ("ddp", "fsdp"):
        first, second = (data["uneven"][strategy] for data in ranks)
        assert first["steps"] == second["steps"] == 9  # rank 0's 52 items: 18 batches
        assert sorted(first["ids"][0]) == EVERY_ITEM[0::2]
        assert sorted(second["ids"][0]) == list(range(1, 40, 2))
    ddp, fsdp = (ranks[0]["uneven"][strategy] for strategy in ("ddp", "fsdp"))
    assert ddp["final"] == ranks[1]["uneven"]["ddp"]["final"], "DDP replicas differ"
    assert ddp["whole"] == ddp["final"]
    # FSDP trained the same updates as DDP, from the same initial weights.
    assert torch.allclose(torch.tensor(fsdp["whole"]), torch.tensor(ddp["whole"]), atol=1e-6)


@pytest.mark.slow
def test_a_rank_without_items_is_the_same_error_everywhere(worlds: Any) -> None:
    """One item for two ranks, none, and one each that drop_last drops (it trained nothing
    and said nothing)."""
    _, ranks = worlds(2)
    assert ranks[0]["empty"] == ranks[1]["empty"]
    errors = ranks[0]["empty"]
    assert "gave rank(s) [1] no item" in errors["1"]
    assert "fewer items than its 2 readers" in errors["1"]
    assert "a stream, gave no item in epoch 1 on any rank" in errors["0"]
    assert "drop_last" not in errors["0"]
    assert (  # an item per rank, dropped: it said the stream was empty or read once only
        "gave no item in epoch 1 on any rank: drop_last=True dropped each rank's last batch, "
        "which held fewer than batch_size_per_gpu=3 items (pass drop_last=False, or a smaller "
        "batch_size_per_gpu)"
    ) in errors["2"]
    assert (  # rank 0's batch of 3 kept, rank 1's 2 items dropped: it blamed the readers
        "gave rank(s) [1] no item while other ranks had some: drop_last=True dropped their "
        "last batch, which held fewer than batch_size_per_gpu=3 items"
    ) in errors["5"]


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("workers", ["0", "2"])
def test_stateful_stream_resumes_mid_epoch_bit_exact(size: int, workers: str, worlds: Any) -> None:
    """Stopped at update 5, resumed from the checkpoint of update 3, on 0 and 2 workers."""
    _, ranks = worlds(size)
    for data in ranks:
        run = data["resume"][workers]
        assert (run["stopped_at"], run["resumed_at"]) == (5, 3)
        assert run["steps"] == (36 if size == 1 else 18)
        assert run["resumed"] == run["straight"]


@pytest.mark.slow
def test_a_rank_whose_part_ended_resumes_with_fillers(worlds: Any) -> None:
    """The checkpoint of update 6 was taken after rank 1's part had ended: the resumed run
    fills for rank 1 and ends as the straight run (it raised '... fewer items than its 2
    readers' on every rank)."""
    _, ranks = worlds(2)
    for data in ranks:
        run = data["resume_after_end"]
        assert (run["stopped_at"], run["resumed_at"], run["steps"]) == (8, 6, 9)
        assert run["resumed"] == run["straight"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["at_the_end", "nothing_left", "sharded"])
def test_a_resume_where_a_part_ended_trains_every_item_once(case: str, worlds: Any) -> None:
    """Resumed after the last update of an epoch, whose end the stream's position did not
    show (rank 0 trained items 1, 3, 5, 7 of rank 1 in epoch 2), and after a rank's part
    ended with nothing read since (no batch for its fillers: the resume always failed; or the
    batch read for them moved its stream, which lost its items of epoch 2)."""
    _, ranks = worlds(2)
    for data in ranks:
        run = data["resume_where_a_part_ended"][case]
        assert (run["stopped_at"], run["resumed_at"]) == (3 if case == "at_the_end" else 2,) * 2
        assert run["steps"] == 6
        assert run["resumed"] == run["straight"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["whole", "sharded"])
def test_a_run_resumed_twice_in_an_epoch_with_workers_is_bit_exact(case: str, worlds: Any) -> None:
    """2 workers, stopped after update 1 and, resumed, after update 2: the second resume
    trained items again (a worker's state saved from before the first resume; a worker whose
    part had ended read it whole again)."""
    _, ranks = worlds(2)
    for data in ranks:
        run = data["resumed_twice"][case]
        assert (run["resumed_at"], run["steps"]) == (2, 8)
        assert run["resumed"] == run["straight"]


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
def test_set_epoch_reaches_persistent_workers(size: int, worlds: Any) -> None:
    """Every epoch in its own order with persistent workers too (they repeated epoch 1's)."""
    _, ranks = worlds(size)
    for data in ranks:
        fresh, persistent = data["persistent"]["False"], data["persistent"]["True"]
        assert persistent == fresh
        assert persistent[0] != persistent[1]
    for epoch in range(2):
        seen = sorted(i for data in ranks for i in data["persistent"]["True"][epoch])
        assert seen == EVERY_ITEM, f"epoch {epoch}"


@pytest.mark.slow
@pytest.mark.parametrize("size", [1, 2])
def test_stream_without_state_restarts_its_epoch(size: int, worlds: Any) -> None:
    result, ranks = worlds(size)
    assert "cannot continue its interrupted epoch: it has no state_dict()" in result.output
    seen = sorted(i for data in ranks for i in data["restart"]["ids"][0])
    assert seen == EVERY_ITEM  # the whole epoch again after resuming at update 3
    assert {data["restart"]["steps"] for data in ranks} == {3 + (18 if size == 1 else 9)}


class Numbers(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(self.n, dtype=torch.float32).view(-1, 1))


def test_shards_split_the_stream_by_rank_and_worker() -> None:
    """Item i goes to reader i % (ranks x workers); readers' parts make the whole stream."""
    parts = []
    for rank in range(2):
        loader = DataLoader(StreamShard(Numbers(23), rank, 2), batch_size=None, num_workers=2)
        parts.append(sorted(int(x) for x in loader))
    assert parts[0] == [i for i in range(23) if i % 4 in (0, 1)]
    assert parts[1] == [i for i in range(23) if i % 4 in (2, 3)]


def _stream_trainer(n: int = 10, **kwargs: Any) -> DistTrainer:
    model = torch.nn.Linear(1, 1)
    return DistTrainer(
        Numbers(n), model, loss=lambda out, batch: out.pow(2).mean(), device="cpu", **kwargs
    )


class StopIn4thUpdate(Callback):
    def on_backward_end(self) -> None:
        if self.trainer.state.global_step == 3:
            self.trainer.request_stop()  # agreed at update 4's log step (print_every=1)


# 256 MiB: the 4 windows in one agreement; 1e-9: one window per agreement, so that the end of
# the pass is in the agreement under way at the last update
@pytest.mark.parametrize("read_ahead_mb", [256.0, 1e-9])
def test_a_stop_at_a_streams_last_update_completes_the_epoch_and_its_checkpoint(
    read_ahead_mb: float, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop at a stream's last update ends the epoch, whose checkpoint is written (before, the
    epoch was left incomplete and none was: a rerun trained that update again); a checkpoint
    due at the last update of an epoch is written once (before, twice)."""
    stopped = _stream_trainer(
        8, batch_size_per_gpu=2, n_epochs=2, print_every=1, save_path=str(tmp_path / "stop"),
        checkpoint_every=100, use_tqdm=False, callbacks_all=[StopIn4thUpdate()],
        stream_read_ahead_mb=read_ahead_mb,
    )  # fmt: skip
    assert stopped.train(resume=False)["steps"] == 4  # the 4th update ends the epoch (8 items)
    assert stopped.state.epoch_complete
    assert [p.name for p in (tmp_path / "stop" / "checkpoints").glob("step-*")] == [
        "step-00000004.pt"
    ]
    every2 = _stream_trainer(
        8, batch_size_per_gpu=2, n_epochs=2, save_path=str(tmp_path / "every"), checkpoint_every=2,
        keep_checkpoints=10, use_tqdm=False, stream_read_ahead_mb=read_ahead_mb,
    )  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastdist"):
        assert every2.train(resume=False)["steps"] == 8
    written = [r.getMessage().rsplit("-", 1)[1] for r in caplog.records if "written" in r.msg]
    assert written == ["00000002.pt", "00000004.pt", "00000006.pt", "00000008.pt"]


class SigtermIn4thUpdate(Callback):
    """SIGTERM to this process in update 4 (a pre-emption, agreed at its log step); records
    the epoch of every micro-batch trained."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_batch_begin(self, batch: Any) -> None:
        self.epochs.append(self.trainer.state.epoch)

    def on_backward_end(self) -> None:
        if self.trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preemption_at_a_streams_last_update_resumes_at_the_next_epoch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Pre-empted at the last update of an epoch of a stream with no state of its own: the
    resumed run reads nothing more of that epoch (an audit: it trained the whole epoch again,
    which it could not continue) and ends as one that never stopped."""
    runs = []
    for _ in range(2):
        callback = SigtermIn4thUpdate()
        trainer = _stream_trainer(
            8, batch_size_per_gpu=2, n_epochs=2, print_every=1, save_path=str(tmp_path),
            use_tqdm=False, callbacks_all=[callback],
        )  # fmt: skip
        runs.append((trainer, callback))
    try:
        with pytest.raises(SystemExit, match="143"):
            runs[0][0].train()
    finally:  # the pre-emption's exit leaves SIGTERM ignored, for a process that then ends
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert runs[0][1].epochs == [1] * 4
    with caplog.at_level(logging.INFO, logger="fastdist"):
        assert runs[1][0].train()["steps"] == 8
    assert runs[1][1].epochs == [2] * 4  # epoch 1 not read again
    assert "restarts from its start" not in caplog.text


def test_stream_refuses_a_sampler() -> None:
    with pytest.raises(ValueError, match="sampler= and batch_sampler= do not apply to a stream"):
        _stream_trainer(sampler=range(10))


def test_warmup_by_fraction_needs_a_known_length() -> None:
    trainer = _stream_trainer(callbacks_all=[WarmupCallback(warmup=0.1)], use_tqdm=False)
    with pytest.raises(ValueError, match=r"give warmup as a number of updates"):
        trainer.train()
    counted = _stream_trainer(callbacks_all=[WarmupCallback(warmup=2)], use_tqdm=False)
    assert counted.train()["steps"] == 2  # 10 items, batches of 8


def test_log_line_of_an_unknown_length(caplog: pytest.LogCaptureFixture) -> None:
    progress = Progress(show=True, use_tqdm=False, total=None, initial=0, global_batch=8)
    with caplog.at_level(logging.INFO, logger="fastdist"):
        progress.mark(5, lr=0.1)
        progress.log(epoch=1, step=5, total=None, loss=0.5)
    assert "epoch 1 step 5/? loss 0.5000" in caplog.text


class Positioned(Numbers):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_a_sharded_stream_reads_its_state_of_before_the_ended_flag() -> None:
    """Its state is {dataset, ended} now; one a checkpoint holds from before is the dataset's."""
    stream = ShardedStream(Positioned(4))
    stream.load_state_dict({"position": 3})
    assert stream.dataset.position == 3
    assert stream.state_dict() == {"dataset": {"position": 3}, "ended": False}
    stream.load_state_dict({"dataset": {"position": 1}, "ended": True})
    assert stream.dataset.position == 1 and list(stream) == []  # ended: nothing more this pass
    assert len(list(stream)) == 4  # the next pass reads it all
