"""fastdist's rank queries, collectives, rank_zero_first and logger, in real worlds.

The distributed tests launch tests/workers/helpers_worker.py once per world (torchrun with 2
processes, torchrun with 1, and a plain ``python`` process without torchrun) and check the JSON
each rank wrote and the output the launch captured. The launcher itself is tested too.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launch import Result, _checked, free_port, run_python, run_torchrun

from fastdist.distributed import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    is_master,
    rank_zero_first,
    rank_zero_only,
)

WORKER = Path(__file__).resolve().parent / "workers" / "helpers_worker.py"


@dataclass
class World:
    """One launch of the worker: how it was launched, its output and each rank's JSON."""

    name: str
    size: int
    result: Result
    ranks: list[dict[str, Any]]


# name -> (use torchrun, number of processes)
WORLDS = {"torchrun-2": (True, 2), "torchrun-1": (True, 1), "python": (False, 1)}


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> World:
    """Run the logger, rank_zero_first and collectives cases in one launch per world."""
    name: str = request.param
    torchrun, size = WORLDS[name]
    out = tmp_path_factory.mktemp(name)
    args = ["logger,rank_zero_first,collectives", str(out)]
    result = run_torchrun(WORKER, size, args) if torchrun else run_python(WORKER, args)
    ranks = []
    for rank in range(size):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results\n{result.describe()}"
        ranks.append(json.loads(path.read_text()))
    return World(name, size, result, ranks)


@pytest.mark.slow
def test_rank_queries(world: World) -> None:
    for rank, data in enumerate(world.ranks):
        meta, got = data["meta"], data["collectives"]
        assert meta["torchrun"] == (world.name != "python")
        assert not meta["group_at_start"], "the group must be created lazily"
        assert (meta["rank"], meta["world_size"], meta["local_rank"]) == (rank, world.size, rank)
        assert (got["rank"], got["world_size"], got["local_rank"]) == (rank, world.size, rank)
        assert (got["rank_after"], got["world_size_after"]) == (rank, world.size)
        assert got["is_master"] == (rank == 0)


@pytest.mark.slow
def test_collectives(world: World) -> None:
    for rank, data in enumerate(world.ranks):
        got = data["collectives"]
        assert got["barrier_returned"]
        # A group is created only when there is more than one process.
        assert got["group_initialized"] == (world.size > 1)
        assert got["is_distributed"] == (world.size > 1)
        assert got["gathered"] == [{"rank": r} for r in range(world.size)]
        assert got["broadcast"] == {"from": 0, "payload": [1, 2, 3]}
        assert got["broadcast_from_last"] == f"from-{world.size - 1}"
        assert got["rank_zero_only"] == ("ran-on-0" if rank == 0 else None)
        assert got["all_reduce_sum"] == world.size * (world.size + 1) / 2


@pytest.mark.slow
def test_rank_zero_first(world: World) -> None:
    for rank, data in enumerate(world.ranks):
        for mode in ("local", "global"):
            got = data["rank_zero_first"][mode]
            if rank == 0:
                assert not got["ready_at_entry"], f"{mode}: rank 0 found the flag already"
            else:
                # Rank 0 sleeps 1 s in the block before writing the flag.
                assert got["ready_at_entry"], f"{mode}: rank {rank} entered before rank 0 left"
                assert got["entered_after_s"] >= 0.9, got


@pytest.mark.slow
def test_logger(world: World) -> None:
    out, err = world.result.stdout, world.result.stderr
    assert "-from-rank-" not in out, "the logger writes to stderr"
    if world.size > 1:
        assert not world.ranks[1]["logger"]["group_at_first_log"]
    for phase in ("before-group", "after-barrier"):
        for rank in range(world.size):
            tag = f" [rank {rank}]" if world.size > 1 else ""
            warning = f"WARNING{tag} warn-from-rank-{rank} {phase}"
            assert re.search(rf"^\S+ \S+ {re.escape(warning)}$", err, re.M), world.result.describe()
            info = f"INFO{tag} info-from-rank-{rank} {phase}"
            if rank == 0:
                assert info in err, world.result.describe()
            else:
                assert f"info-from-rank-{rank}" not in err, "INFO must show on rank 0 only"
    if world.size == 1:
        assert "[rank" not in err, "a one-process world is not tagged"


@pytest.mark.slow
def test_run_torchrun_reports_a_failing_rank(tmp_path: Path) -> None:
    """One launch: with ``check=False`` the failed result; the check ``check=True`` makes
    of it (run_torchrun returns ``_checked(result, check)``) raises showing every rank."""
    result = run_torchrun(WORKER, 2, ["fail", str(tmp_path)], check=False)
    assert result.returncode != 0
    assert "deliberate-failure-on-rank-1" in result.stderr
    with pytest.raises(AssertionError) as info:
        _checked(result, check=True)
    message = str(info.value)
    assert message.startswith("launch failed\n") and result.describe() in message
    assert "deliberate-failure-on-rank-1" in message
    assert "fail-case-rank-0-started" in message, "every rank's output is shown"


@pytest.mark.slow
def test_run_python_reports_failure(tmp_path: Path) -> None:
    result = run_python(WORKER, ["fail", str(tmp_path)], check=False)
    assert result.returncode == 1
    assert "fail-case-rank-0-started" in result.stdout
    assert "deliberate-failure-on-rank-0" in result.stderr
    assert result.output == result.stdout + result.stderr
    with pytest.raises(AssertionError, match="deliberate-failure-on-rank-0"):
        _checked(result, check=True)  # what run_python(check=True) returns
    assert _checked(result, check=False) is result


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.long  # waits out a 15 s timeout: tests the tests' launcher
def test_run_torchrun_timeout_kills_every_rank(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="timed out") as info:
        run_torchrun(WORKER, 2, ["hang", str(tmp_path)], timeout=15)
    assert "hang-case-rank-0-sleeping" in str(info.value), "output so far is shown"
    assert "hang-case-rank-1-sleeping" in str(info.value)
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), "ranks outlived the launch"


# In-process tests: a one-process world without a process group.


@pytest.mark.usefixtures("no_dist_env")
def test_one_process_world() -> None:
    assert (get_rank(), get_world_size(), get_local_rank()) == (0, 1, 0)
    assert is_master() and not is_distributed()
    barrier()  # returns at once
    assert all_gather_object({"a": 1}) == [{"a": 1}]
    assert broadcast_object([1, 2]) == [1, 2]
    assert all_reduce_sum(torch.tensor([2.0])).item() == 2.0
    assert rank_zero_only(lambda x: x + 1)(1) == 2
    entered = []
    with rank_zero_first():
        entered.append("local")
    with rank_zero_first(local=False):
        entered.append("global")
    assert entered == ["local", "global"]
    assert init_distributed() is False
    assert not dist.is_initialized()


@pytest.mark.usefixtures("no_dist_env")
def test_ranks_come_from_torchrun_env_before_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (get_rank(), get_world_size(), get_local_rank()) == (1, 2, 1)
    assert not is_master() and not is_distributed()
    assert rank_zero_only(lambda: "value")() is None


@pytest.mark.usefixtures("no_dist_env")
def test_init_distributed_needs_init_method_for_several_processes() -> None:
    with pytest.raises(ValueError, match="init_method"):
        init_distributed(world_size=2)
    assert not dist.is_initialized()


def test_free_port() -> None:
    port = free_port()
    assert 0 < port < 65536
