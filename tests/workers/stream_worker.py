"""Worker for tests/test_stream.py: streaming (``IterableDataset``) training in a real world.

Usage (under torchrun or as a plain process): ``stream_worker.py OUT_DIR``. Writes
``OUT_DIR/rank<R>.json`` with every case's result.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from data_worker import StopAt, _resume_pair
from torch.utils.data import IterableDataset, get_worker_info
from trainer_worker import SampleIds, ToyData, flat_params, make_trainer, write_json
from workers.ending import exit_now

from fastdist import AccuracyMetric, Callback, DistTrainer, get_rank, get_world_size
from fastdist.data import ShardedStream

N_ITEMS = 103
# Batches of 3 split 103 items unevenly over 2 ranks: 52 items make 18 batches, 51 make 17.
STREAM_BATCH = 3


class Stream(IterableDataset):
    """The first ``n`` samples of ``ToyData(N_ITEMS)``, in order, as a stream."""

    def __init__(self, n: int = N_ITEMS) -> None:
        self.data = ToyData(N_ITEMS)
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            yield self.data[i]


class StatefulStream(Stream):
    """Samples ``first`` to ``n - 1`` as a stream that saves its position (torchdata's
    ``Stateful`` protocol): that of the current iteration, back to 0 when one ends (the next
    epoch starts afresh)."""

    def __init__(self, n: int = N_ITEMS, first: int = 0) -> None:
        super().__init__(n)
        self.first = first
        self.position = 0  # items of the current iteration read

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start, self.position = self.position, 0
        for i in range(self.first + start, self.n):
            self.position = i + 1 - self.first
            yield self.data[i]
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class WorkerPart(StatefulStream):
    """A StatefulStream split among the DataLoader workers reading it (item ``i`` to worker
    ``i % workers``), as a source of many files is: each worker's copy keeps its position."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        for item in super().__iter__():
            if item["idx"] % workers == worker:
                yield item


class OwnPart(Stream):
    """Reads only its reader's contiguous range of the items, as a sharded source does
    (readers: DataLoader workers of all ranks; the ranges differ in length by one). The rank
    is read when it is built, in the main process: ``__iter__`` runs in forked DataLoader
    workers, where torch.distributed must not be called."""

    def __init__(self) -> None:
        super().__init__()
        self.rank, self.world_size = get_rank(), get_world_size()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        readers, reader = self.world_size * workers, self.rank * workers + worker
        for i in range(self.n * reader // readers, self.n * (reader + 1) // readers):
            yield self.data[i]


def stream_trainer(data: IterableDataset, **kwargs: Any) -> DistTrainer:
    """The toy trainer on a stream: batches of 3, update_every 2, two epochs, 60 s timeout."""
    torch.manual_seed(0)
    options = {"batch_size_per_gpu": STREAM_BATCH, "update_every": 2, "n_epochs": 2}
    if kwargs.get("num_workers"):  # forked workers can hang on Python < 3.11.10 (see
        options["multiprocessing_context"] = "forkserver"  # fastdist.data.workers)
    return make_trainer(data, timeout=60, **{**options, **kwargs})


def checkpointed_each_update(
    data: IterableDataset, callbacks: list[Callback], save_path: Path | None, **kwargs: Any
) -> DistTrainer:
    """The stream trainer with batches of 2, one per update, a log step and a checkpoint
    after each update (what the resume cases stop and resume at)."""
    return stream_trainer(
        data,
        batch_size_per_gpu=2,
        update_every=1,
        print_every=1,
        checkpoint_every=1,
        callbacks_all=callbacks,
        save_path=save_path,
        **kwargs,
    )


def case_coverage() -> dict[str, Any]:
    """Sample ids per epoch with 0 and 2 DataLoader workers; evaluation and log steps run."""
    results = {}
    for workers in (0, 2):
        ids = SampleIds()
        trainer = stream_trainer(
            Stream(),
            num_workers=workers,
            callbacks_all=[ids],
            dev_data=ToyData(30, seed=1),
            metrics=AccuracyMetric(),
            print_every=3,
        )
        result = trainer.train()
        results[str(workers)] = {
            "ids": ids.epochs,
            "steps": result["steps"],
            "best_eval": result["best_eval"],
            "total_steps": trainer.state.total_steps,
            "final": flat_params(trainer.model),
        }
    return results


def case_sharded() -> dict[str, Any]:
    """A stream that shards itself, wrapped in ShardedStream, 2 workers: read as it is."""
    ids = SampleIds()
    stream_trainer(ShardedStream(OwnPart()), num_workers=2, callbacks_all=[ids]).train()
    return {"ids": ids.epochs}


def case_uneven() -> dict[str, Any]:
    """A rank-dependent stream (against the rule, to force a very uneven split): rank 0 keeps
    52 of its 103 items, rank 1 20 of its 40; rank 1 fills while rank 0 trains on. Under DDP,
    and under FSDP, where every forward is a collective."""
    results = {}
    for strategy in ("ddp", "fsdp"):
        ids = SampleIds()
        n = 40 if get_rank() == 1 else N_ITEMS
        trainer = stream_trainer(Stream(n), callbacks_all=[ids], n_epochs=1, strategy=strategy)
        steps = trainer.train()["steps"]
        final = flat_params(trainer.model) if strategy == "ddp" else None  # FSDP: shards
        full = trainer.strategy.full_state_dict()  # rank 0: the whole model, else None
        whole = None if full is None else torch.cat([t.flatten() for t in full.values()])
        results[strategy] = {
            "ids": ids.epochs,
            "steps": steps,
            "final": final,
            "whole": None if whole is None else whole.tolist(),
        }
    return results


def case_empty() -> dict[str, Any]:
    """One item for two ranks (rank 1 has nothing to repeat), and none: every rank must say
    so."""
    errors: dict[str, Any] = {}
    # 2: an item per rank, fewer than a batch, dropped by drop_last; 5: rank 1's 2 dropped
    for n in (1, 0, 2, 5):
        try:
            stream_trainer(Stream(n), n_epochs=1, drop_last=n in (2, 5)).train()
        except (RuntimeError, ValueError) as exc:
            errors[str(n)] = str(exc)
    return errors


def case_resume(out: Path) -> dict[str, Any]:
    """A stateful stream resumed mid-epoch (0 and 2 workers): bit-exact weights."""
    results = {}
    for workers in (0, 2):

        def build(
            callbacks: list[Callback], save_path: Path | None, workers: int = workers
        ) -> DistTrainer:
            return stream_trainer(
                StatefulStream(),
                num_workers=workers,
                callbacks_all=callbacks,
                save_path=save_path,
                print_every=1,
                checkpoint_every=3,
            )

        results[str(workers)] = _resume_pair(build, out / f"resume-{workers}-{get_world_size()}")
    return results


def case_resume_after_end(out: Path) -> dict[str, Any]:
    """A stateful stream whose rank-1 part (20 items, 7 batches) ends at update 4 of 9:
    stopped after update 7, resumed from the checkpoint of update 6, where rank 1 has nothing
    left but must still run fillers."""

    def build(callbacks: list[Callback], save_path: Path | None) -> DistTrainer:
        n = 40 if get_rank() == 1 else N_ITEMS  # against the rule, to force an early end
        options = {"print_every": 1, "checkpoint_every": 3, "n_epochs": 1}
        return stream_trainer(
            StatefulStream(n), callbacks_all=callbacks, save_path=save_path, **options
        )

    return _resume_pair(build, out / "resume-after-end", stop_at=7)


def case_resume_where_a_part_ended(out: Path) -> dict[str, Any]:
    """Resumed where a rank's part of a stateful stream had ended, two epochs each. 9 items,
    batches of 2, one per update: rank 0 reads 0, 2, 4, 6, 8 in 3 batches, rank 1 reads 1, 3,
    5, 7 in 2. After update 3, the last of epoch 1, which the stream's position (back at 0)
    does not show; after update 2, where rank 1's part has ended and it reads nothing once
    resumed. And a ShardedStream whose rank 1 part (1 item) ends before rank 0's (5), after
    update 2, where rank 1 has nothing left and rank 0 one batch."""

    def whole(callbacks: list[Callback], save_path: Path | None) -> DistTrainer:
        return checkpointed_each_update(StatefulStream(9), callbacks, save_path)

    def sharded(callbacks: list[Callback], save_path: Path | None) -> DistTrainer:
        part = StatefulStream(5) if get_rank() == 0 else StatefulStream(6, first=5)
        return checkpointed_each_update(ShardedStream(part), callbacks, save_path)

    return {
        "at_the_end": _resume_pair(whole, out / "end-of-epoch", stop_at=3),
        "nothing_left": _resume_pair(whole, out / "nothing-left", stop_at=2),
        "sharded": _resume_pair(sharded, out / "sharded-part-ended", stop_at=2),
    }


def case_resumed_twice(out: Path) -> dict[str, Any]:
    """Stopped after update 1, resumed and stopped again after update 2, resumed again: 2
    workers, 11 items read whole, and a ShardedStream of parts of 7 and 2 items split among
    the workers (a worker whose part ended read it all again; a worker that had read nothing
    since the first resume saved its state from before it, and read its items again)."""

    def whole(callbacks: list[Callback], save_path: Path | None) -> DistTrainer:
        return checkpointed_each_update(StatefulStream(11), callbacks, save_path, num_workers=2)

    def sharded(callbacks: list[Callback], save_path: Path | None) -> DistTrainer:
        part = WorkerPart(7) if get_rank() == 0 else WorkerPart(9, first=7)
        return checkpointed_each_update(ShardedStream(part), callbacks, save_path, num_workers=2)

    results = {}
    for name, build in (("whole", whole), ("sharded", sharded)):
        straight = build([StopAt(-1)], None)
        straight.train()
        for stop in (1, 2):
            build([StopAt(stop)], out / f"twice-{name}").train()
        resumed = build([StopAt(-1)], out / f"twice-{name}")
        steps = resumed.train()["steps"]
        results[name] = {
            "straight": flat_params(straight.model),
            "resumed": flat_params(resumed.model),
            "steps": steps,
            "resumed_at": resumed.callbacks_all[-1].began_at,
        }
    return results


class EpochShuffled(Stream):
    """The stream in an order drawn from the epoch set by ``set_epoch``."""

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        for i in order.tolist():
            yield self.data[i]


def case_persistent() -> dict[str, Any]:
    """set_epoch reaches persistent DataLoader workers: each epoch its own order, as with
    workers started anew every epoch."""
    results = {}
    for persistent in (False, True):
        ids = SampleIds()
        stream_trainer(
            EpochShuffled(), num_workers=2, persistent_workers=persistent, callbacks_all=[ids]
        ).train()
        results[str(persistent)] = ids.epochs
    return results


def case_restart(out: Path) -> dict[str, Any]:
    """A stream without state resumed mid-epoch restarts the epoch: every item again."""
    save_path = out / f"restart-{get_world_size()}"
    stream_trainer(
        Stream(),
        callbacks_all=[StopAt(4), SampleIds()],
        save_path=save_path,
        print_every=1,
        checkpoint_every=3,
        n_epochs=1,
    ).train()
    ids = SampleIds()
    resumed = stream_trainer(
        Stream(),
        callbacks_all=[StopAt(-1), ids],
        save_path=save_path,
        print_every=1,
        checkpoint_every=3,
        n_epochs=1,
    )
    steps = resumed.train()["steps"]
    return {"ids": ids.epochs, "steps": steps}


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    results = {
        "coverage": case_coverage(),
        "sharded": case_sharded(),
        "resume": case_resume(out),
        "restart": case_restart(out),
        "persistent": case_persistent(),
    }
    if get_world_size() > 1:
        results.update(
            uneven=case_uneven(),
            empty=case_empty(),
            resume_after_end=case_resume_after_end(out),
            resume_where_a_part_ended=case_resume_where_a_part_ended(out),
            resumed_twice=case_resumed_twice(out),
        )
    write_json(out, results)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
