"""``DistTrainer`` end to end in real worlds: 2 ranks under torchrun, and one plain process.

Each world is launched once (tests/workers/trainer_worker.py runs every case in sequence in one
process group, in a temporary working directory); the tests check the JSON each rank wrote.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import Result, run_ranks

WORKER = Path(__file__).resolve().parent / "workers" / "trainer_worker.py"
CASES = "equivalence,comm,coverage,evaluate,hooks,stop,best,fitlog,groups,replicas"
# name -> (use torchrun, number of processes)
WORLDS = {"torchrun-2": (True, 2), "python": (False, 1)}
BATCH = 8  # batch_size_per_gpu of every case

pytestmark = pytest.mark.slow


@dataclass
class World:
    """One launch of the worker: its size, output dir, working dir, output and rank JSONs."""

    name: str
    size: int
    out: Path
    cwd: Path
    result: Result
    ranks: list[dict[str, Any]]

    def case(self, name: str) -> Iterator[tuple[int, Any]]:
        """``(rank, result of case name)`` for every rank."""
        return ((rank, data[name]) for rank, data in enumerate(self.ranks))


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], World]:
    """Launch a world on first use and keep it for the module."""
    worlds: dict[str, World] = {}

    def get(name: str) -> World:
        if name not in worlds:
            torchrun, size = WORLDS[name]
            out, cwd = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}-cwd")
            args = [CASES, str(out)]
            result, ranks = run_ranks(WORKER, size, args, out, torchrun, cwd=cwd, timeout=180)
            worlds[name] = World(name, size, out, cwd, result, ranks)
        return worlds[name]

    return get


@pytest.fixture(params=list(WORLDS))
def world(request: pytest.FixtureRequest, launch: Callable[[str], World]) -> World:
    return launch(request.param)


def _same_on_every_rank(world: World, values: list[Any]) -> Any:
    assert all(v == values[0] for v in values), f"ranks of {world.name} differ: {values}"
    return values[0]


def test_worlds(world: World) -> None:
    """torchrun-2 runs in a process group; a plain process trains without one (fallback)."""
    for rank, data in enumerate(world.ranks):
        meta = data["meta"]
        assert (meta["rank"], meta["world_size"]) == (rank, world.size)
        assert meta["torchrun"] == (world.name != "python")
        assert meta["group_at_end"] == (world.size > 1)
    assert list(world.cwd.iterdir()) == [], "the worker wrote into its working directory"


@pytest.mark.parametrize(
    "run",
    [
        "sgd-128",
        "sgd-56",
        "adamw-128",
        "adamw-56",
        "sgd-323",
        "sgd-289",
        "sgd-203",
        "adamw-331",
        "frozen-289",
    ],
)
def test_two_ranks_equal_one_process(run: str, launch: Callable[[str], World]) -> None:
    """2 ranks x 8 x update_every 2 == 1 rank x 8 x update_every 4, after several updates.

    128 samples: 4 full updates per epoch. 56: each rank gets 28 = micro-batches 8, 8, 8, 4,
    windows [8, 8] and [8, 4]; one process has windows of 32 and 24 samples. 323, 331: shards
    one sample apart, nothing repeated; 289: shards of 145 and 144, so rank 1's last window is
    one filler. 203: 1 x 16 == 2 x 8, update_every 1. 2 epochs each.
    """
    one = launch("python").ranks[0]["equivalence"][run]
    n = int(run.split("-")[1])
    assert one["steps"] == 2 * math.ceil(n / (16 if n == 203 else 32))
    reference = torch.tensor(one["final"], dtype=torch.float64)
    moved = (reference - torch.tensor(one["init"], dtype=torch.float64)).abs().max()
    assert moved > 1e-2, "training did not change the weights"
    for rank, runs in launch("torchrun-2").case("equivalence"):
        got = runs[run]
        assert got["init"] == one["init"]
        assert got["steps"] == one["steps"]
        final = torch.tensor(got["final"], dtype=torch.float64)
        assert torch.allclose(final, reference, rtol=0, atol=1e-9), (
            f"rank {rank}: max difference {(final - reference).abs().max().item():.3g}"
        )


def test_a_frozen_batch_norm_stays_frozen(world: World) -> None:
    """A submodule frozen in eval mode stays frozen through rank 1's fillers, the evaluations and
    a callback's ``model.eval()`` (in ``on_train_begin`` too); one a callback freezes in a
    filler's ``on_loss_begin`` stays frozen on that rank too; every micro-batch is announced in
    the training modes; after ``train()`` each module is in the mode it came in. (Two audits:
    ``model.train()`` after a filler or an evaluation unfroze a submodule, on rank 1 alone after
    a filler, so 2 ranks trained another model than 1 process, ``frozen-289`` above; a whole
    ``model.eval()`` in ``on_train_begin`` unfroze it for the run; a freeze in a filler's
    ``on_loss_begin`` was lost on that rank.) Mid-epoch evaluations follow ``on_batch_end``, as
    the documented hook order says, so a checkpoint there never holds a half-run update."""
    for rank, data in enumerate(world.ranks):
        run = data["equivalence"]["frozen-289"]
        assert run["tracked"] == 0, f"rank {rank}: the frozen norm's statistics moved"
        # (root, norm, hidden) as each micro-batch is announced, per epoch
        assert run["modes_seen"] == {"1": [[True, False, True]], "2": [[True, False, False]]}, (
            f"rank {rank}: {run['modes_seen']}"
        )
        assert run["modes_after"] == [True, False, True], f"rank {rank}"
        assert run["before_valid"] == ["on_batch_end"], f"rank {rank}"


def test_one_gradient_all_reduce_per_update(launch: Callable[[str], World]) -> None:
    """update_every=4: DDP's comm hook runs once per bucket per update, never in no_sync.

    No other all-reduce runs during training (print_every exceeds the number of updates, no
    evaluation, no checkpoints), not even at epoch ends, but the signal checks after updates 2
    and 4 (4 numbers each); one checks the losses and the weights after the last epoch.
    """
    for rank, comm in launch("torchrun-2").case("comm"):
        plain, acc = comm["plain"], comm["accumulate"]
        assert plain["has_ddp"] and acc["has_ddp"]
        # update_every=1: every micro-batch is an update; this gives the bucket count.
        assert plain["steps"] == 2 and plain["hook_calls"] % plain["steps"] == 0
        buckets = plain["hook_calls"] // plain["steps"]
        assert buckets >= 1
        assert [mb["hook_calls"] for mb in plain["micro_batches"]] == [buckets] * 2

        # 96 samples: 48 per rank = 6 micro-batches, windows of 4 and 2, for 2 epochs.
        updates = [mb["update"] for mb in acc["micro_batches"]]
        assert updates == [False, False, False, True, False, True] * 2, f"rank {rank}"
        assert acc["steps"] == updates.count(True) == 4
        step = 0
        for i, mb in enumerate(acc["micro_batches"]):
            step += mb["update"]
            assert mb["hook_calls"] == (buckets if mb["update"] else 0), f"rank {rank} mb {i}"
            checks = int(mb["update"] and step in (2, 4))
            assert mb["other_all_reduces"] == checks, f"rank {rank} mb {i}: {mb}"
        assert acc["hook_calls"] == acc["steps"] * buckets
        assert acc["hook_all_reduces"] == acc["hook_calls"], "one all_reduce per hook call"
        assert acc["epoch_end"] == [0, 0], "no all-reduce at epoch ends"
        assert acc["other_all_reduces"] == 1 + 2, "after training, and the 2 signal checks"


def test_one_process_makes_no_all_reduce(launch: Callable[[str], World]) -> None:
    comm = launch("python").ranks[0]["comm"]
    for run in comm.values():
        assert not run["has_ddp"]
        assert run["hook_calls"] == run["other_all_reduces"] == 0
        assert sum(mb["update"] for mb in run["micro_batches"]) == run["steps"] > 0


def test_every_sample_once_per_epoch(world: World) -> None:
    """96 samples, batch 8: each epoch covers every id once across ranks, in a new order."""
    for n in (96, 289):  # 289: shards of 145 and 144, no sample repeated
        epochs = [data["coverage"][str(n)] for data in world.ranks]
        assert all(len(rank_epochs) == 3 for rank_epochs in epochs)
        for epoch in range(3):
            shards = [rank_epochs[epoch] for rank_epochs in epochs]
            sizes = [len(shard) for shard in shards]
            assert sizes == [(n - r + world.size - 1) // world.size for r in range(world.size)]
            assert sorted(i for shard in shards for i in shard) == list(range(n)), f"epoch {epoch}"
        for rank_epochs in epochs:
            assert len({tuple(order) for order in rank_epochs}) == 3, "order must change per epoch"


def test_ranks_take_alternate_positions_of_one_order(launch: Callable[[str], World]) -> None:
    """The premise of equivalence: rank r of 2 trains on positions r::2 of the 1-process order."""
    one = launch("python").ranks[0]["coverage"]["289"]
    for rank, coverage in launch("torchrun-2").case("coverage"):
        for epoch, order in enumerate(coverage["289"]):
            assert order == one[epoch][rank::2], f"rank {rank} epoch {epoch}"


def test_evaluate_is_exact(world: World) -> None:
    """101 dev samples, sharded 51/50 on 2 ranks: every sample scored once, exact accuracy."""
    results = [data["evaluate"] for data in world.ranks]
    evaluation = dict(_same_on_every_rank(world, results))
    direct = evaluation.pop("direct_acc")
    assert 0.1 < direct < 0.9, "accuracy should not be trivially 0 or 1"
    for name, got in evaluation.items():
        assert got == {"acc": direct, "n": 101, "idx_sum": sum(range(101))}, name


def test_evaluate_matches_one_process(launch: Callable[[str], World]) -> None:
    one = launch("python").ranks[0]["evaluate"]
    for _rank, got in launch("torchrun-2").case("evaluate"):
        assert got == one


def expected_hooks(n_micro: int, update_every: int, n_epochs: int) -> list[str]:
    """The documented hook order of a run that evaluates at every epoch end."""
    hooks = ["on_train_begin"]
    for _ in range(n_epochs):
        hooks.append("on_epoch_begin")
        for i in range(n_micro):
            hooks += ["on_batch_begin", "on_loss_begin", "on_backward_begin", "on_backward_end"]
            if (i + 1) % update_every == 0 or i + 1 == n_micro:
                hooks.append("on_step_end")
            hooks.append("on_batch_end")
        hooks += ["on_valid_begin", "on_valid_end", "on_epoch_end"]
    return [*hooks, "on_train_end"]


def test_callback_order(world: World) -> None:
    """callbacks_all on every rank, callbacks_master on rank 0 after them, hooks in order; an
    EchoCallback (fastNLP's: hooks answered by ``__getattribute__``) is called on every hook,
    on the ranks of its list, and so is on_exception when training fails."""
    # 48 samples, update_every 2, 2 epochs: 3 micro-batches per rank on 2 ranks (a short last
    # window), 6 on one.
    hooks = expected_hooks(48 // world.size // BATCH, update_every=2, n_epochs=2)
    for rank, got in world.case("hooks"):
        tags = ["all-a", "all-b", "all-echo"] + (["master", "master-echo"] if rank == 0 else [])
        expected = [[hook, tag] for hook in hooks for tag in tags]
        assert got["log"] == expected, f"rank {rank}"
        failed = [["on_train_begin", "all-echo"], ["on_exception", "all-echo"]]
        failed += [["on_exception", "master-echo"]] if rank == 0 else []
        assert got["failed"] == failed, f"rank {rank}"


def test_stop_requested_on_rank_zero_only(world: World) -> None:
    """Rank 0 requests a stop at update 5; all ranks agree at the next print step (6), whose
    all-reduce is read an update later: all stop after update 7."""
    runs = [data["stop"]["request"] for data in world.ranks]
    assert runs[0]["stop_at"] == 5
    result = _same_on_every_rank(world, [run["result"] for run in runs])
    end = _same_on_every_rank(world, [run["end"] for run in runs])
    assert result["steps"] == end["global_step"] == 7  # print_every=3
    assert end["micro_batches"] == 7 < end["total_steps"]


def test_early_stop_callback(world: World) -> None:
    """lr=0: no evaluation after the first improves, so patience=2 stops after epoch 3."""
    runs = [data["stop"]["early_stop"] for data in world.ranks]
    result = _same_on_every_rank(world, [run["result"] for run in runs])
    end = _same_on_every_rank(world, [run["end"] for run in runs])
    steps_per_epoch = end["total_steps"] // 10
    assert end["epoch"] == 1 + runs[0]["patience"]
    assert result["steps"] == end["global_step"] == 3 * steps_per_epoch
    assert (result["best_epoch"], result["best_step"]) == (1, steps_per_epoch)


def test_a_stop_is_logged_once(world: World) -> None:
    """Each stop of the stop case (a request, then early stopping) is logged once, by rank 0,
    not again at the syncs after it (the end of training's)."""
    early = world.ranks[0]["stop"]["early_stop"]["result"]["steps"]
    stops = re.findall(r"stop requested; stopping at step (\d+)", world.result.output)
    assert stops == ["7", str(early)], world.result.describe()


@pytest.mark.parametrize("mode", ["file", "memory"])
def test_best_model(world: World, mode: str) -> None:
    """Scores 0.2, 0.9, 0.5 (file) and NaN, 0.9, 0.5 (memory): the epoch-2 weights are kept
    and loaded back on every rank."""
    runs = [data["best"][mode] for data in world.ranks]
    result = _same_on_every_rank(world, [run["result"] for run in runs])
    steps_per_epoch = runs[0]["total_steps"] // 3
    assert set(result) == {"best_eval", "best_epoch", "best_step", "steps", "seconds"}
    assert result["best_eval"] == {"score": 0.9}
    assert (result["best_epoch"], result["best_step"]) == (2, 2 * steps_per_epoch)
    assert result["steps"] == 3 * steps_per_epoch
    assert isinstance(result["seconds"], float) and result["seconds"] >= 0
    for rank, run in enumerate(runs):
        assert run["final_params"] == run["best_params"], f"rank {rank}: best not loaded"
        assert run["final_params"] != run["last_params"], "the last epoch should differ"
        if mode == "memory" or rank > 0:
            assert run["best_model_path"] is None
    if mode == "memory":
        return
    for rank in range(1, world.size):
        assert not (world.out / f"save-rank{rank}").exists(), f"rank {rank} wrote a file"
    entries = list((world.out / "save-rank0").iterdir())
    files = [f for f in entries if f.suffix == ".pt"]  # besides checkpoints/ and log.jsonl
    assert [f.name for f in files] == [Path(runs[0]["best_model_path"]).name], entries
    kept = {files[0].name, "log.jsonl", ".fastdist.lock"}  # the lock file stays: see checkpoints
    assert {f.name for f in entries if f.is_file()} == kept
    assert {f.name for f in entries if f.is_dir()} == {"checkpoints"}
    assert re.fullmatch(r"best_ToyNet_score_[\d-]+\.pt", files[0].name)
    saved = torch.load(files[0], weights_only=True)
    flat = torch.cat([tensor.flatten() for tensor in saved.values()]).tolist()
    for rank, run in enumerate(runs):
        assert run["final_params"] == flat, f"rank {rank} does not hold the saved best model"


def _fitlog_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a fitlog ``*.log`` file (lines ``[Step:N<TAB>]{json}``)."""
    lines = path.read_text().splitlines()
    return [json.loads(line.split("\t", 1)[-1]) for line in lines if line.strip()]


def _fitlog_dir(world: World) -> Path:
    logs = list((world.out / "fitlog-rank0").iterdir())
    assert len(logs) == 1 and logs[0].name.startswith("log_"), logs
    return logs[0]


def test_fitlog_on_rank_zero_only(world: World) -> None:
    for rank in range(1, world.size):
        assert not (world.out / f"fitlog-rank{rank}").exists(), f"rank {rank} wrote fitlog"
    log_dir = _fitlog_dir(world)
    assert {"state": "finish"} in [r["meta"] for r in _fitlog_records(log_dir / "meta.log")]
    hypers = {k: v for r in _fitlog_records(log_dir / "hyper.log") for k, v in r["hyper"].items()}
    assert hypers["world_size"] == world.size and hypers["lr"] == 0.1
    assert hypers["batch_size_per_gpu"] == BATCH and hypers["n_epochs"] == 2  # the config
    evals = world.ranks[0]["fitlog"]["evals"]
    metrics = [r["metric"] for r in _fitlog_records(log_dir / "metric.log")]
    assert [m for m in metrics if "dev/acc" in m] == [{"dev/acc": e["acc"]} for e in evals]
    best = [r["metric"] for r in _fitlog_records(log_dir / "best_metric.log")]
    test_acc = world.ranks[0]["fitlog"]["test"]["acc"]
    assert best[-1] == {"test/acc": test_acc}  # log_test after training
    assert {"dev/acc": max(e["acc"] for e in evals)} in best


def test_fitlog_logs_the_reduced_loss_of_each_print_step(world: World) -> None:
    """print_every=1: fitlog gets the loss the trainer reduced at every update, by step."""
    expected = {step: loss for step, loss in world.ranks[0]["fitlog"]["losses"]}
    # 32 samples, 2 epochs, update_every 1: 4 updates on 2 ranks, 8 on one.
    assert list(expected) == list(range(1, 1 + 64 // BATCH // world.size))
    assert None not in expected.values()
    records = _fitlog_records(_fitlog_dir(world) / "loss.log")
    logged = {r["step"]: r["loss"]["loss"] for r in records}
    assert logged == expected


def test_a_dropped_trainer_frees_its_process_groups(world: World) -> None:
    """The groups a trainer creates (its timeout group, a stream's agreement group, local
    SGD's subgroup) go with it: no file descriptor leaks (5 per trainer did)."""
    for _rank, run in world.case("groups"):
        first, *rest = run["fds"]
        assert rest == [first] * len(rest), run["fds"]


def test_replicas_are_compared_after_the_last_update_by_default(world: World) -> None:
    """A learning rate raised on rank 0 only trains replicas apart: by default every rank
    raises after the last update, naming a parameter (before: a wrong model, silently);
    ``check_sync_every=0`` turns it off; a master callback's change in ``on_train_end`` (after
    the comparison) is rank 0's own."""
    for rank, run in world.case("replicas"):
        if world.size > 1:
            assert "differs across ranks at step 4 (checksums by rank:" in run["caught"], run
            assert run["caught"].startswith("parameter 'hidden."), run
            assert "(e.g. the learning rate), or requires_grad changed" in run["caught"]
            assert "; make the change on every rank, in callbacks_all" in run["caught"]
        else:
            assert run["caught"] == ""  # one process: one copy
        assert run["off_steps"] == 8 // world.size
        assert run["zeroed"] == (rank == 0)
