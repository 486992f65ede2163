"""The layout's one owner (``Topology``) in process, and in real worlds of 1, 2, 4 and 8 ranks
(tests/workers/topology_worker.py): the data each rank trains on under tensor parallelism
(token batches, a sharded stream) and HSDP, all against one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_ranks
from workers.fsdp_worker import BlockNet

from fastdist.strategies import DDP, FSDP, Topology
from fastdist.strategies.topology import DataShard

WORKER = Path(__file__).resolve().parent / "workers" / "topology_worker.py"
INITIAL = torch.cat([p.detach().flatten() for p in BlockNet().parameters()])


def test_layout_of_hsdp_with_tp() -> None:
    """8 ranks as 2 replica groups x 2 shards x 2 tensor-parallel peers (peers adjacent)."""
    layouts = [Topology(FSDP(replicate=2, tp=2).degrees(8), r, 8) for r in range(8)]
    assert layouts[0].dims == ("dp_replicate", "dp_shard", "tp")
    shards = [t.data_shard for t in layouts]
    assert [s.rank for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {s.size for s in shards} == {4}
    assert [s.primary for s in shards] == [True, False] * 4
    assert [t.coordinate("dp_replicate") for t in layouts] == [0] * 4 + [1] * 4
    assert layouts[0].copies == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layouts[5].ranks_along(5, "tp") == [4, 5]
    assert all(t.holds_loss and t.shards_parameters for t in layouts)


def test_layout_of_ddp_and_one_process() -> None:
    ddp = Topology(DDP().degrees(4), 2, 4)
    assert ddp.data_shard == DataShard(2, 4) and ddp.copies == [[0, 1, 2, 3]]
    assert not ddp.shards_parameters
    one = Topology(FSDP().degrees(1), 0, 1)
    assert one.data_shard == DataShard(0, 1) and not one.shards_parameters


def test_layout_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"FSDP\(replicate=3\) .* not a multiple of replicate=3"):
        FSDP(replicate=3).degrees(4)
    with pytest.raises(ValueError, match=r"replicate=2 x tp=2: launch a multiple of 4"):
        FSDP(replicate=2, tp=2, tp_plan={"a": "colwise"}).degrees(6)
    with pytest.raises(ValueError, match="replicate must be"):
        FSDP(replicate=0)
    with pytest.raises(ValueError, match="holds 2 ranks, but the world has 4"):
        Topology({"dp_shard": 2}, 0, 4)


def test_topology_of_a_strategy_name_names_the_object_to_pass() -> None:
    with pytest.raises(TypeError, match=r"Topology.of\(FSDP\(\)\) for 'fsdp'"):
        Topology.of("fsdp")  # type: ignore[arg-type]


def test_ddp_script_makes_no_mesh() -> None:
    """A one-process run asks the layout, never a DeviceMesh."""
    code = (
        "import torch, fastdist\n"
        "from fastdist.strategies.topology import _MESHES\n"
        "m = torch.nn.Linear(2, 2)\n"
        "data = [(torch.ones(2), torch.ones(2))] * 4\n"
        "t = fastdist.DistTrainer(data, m, loss=torch.nn.MSELoss(), use_tqdm=False, "
        "device='cpu')\n"
        "t.train()\n"
        "print(t.topology.data_shard, len(_MESHES))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().endswith("DataShard(rank=0, size=1, primary=True) 0"), out.stdout


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("topology")


def launch(out: Path, mode: str, size: int, timeout: float = 240) -> list[dict[str, Any]]:
    _, ranks = run_ranks(
        WORKER, size, [mode, str(out)], out / mode, size > 1, cwd=out, timeout=timeout
    )
    return ranks


@pytest.fixture(scope="module")
def one(out: Path) -> dict[str, Any]:
    return launch(out, "one", 1)[0]


def params(run: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(run["params"])


@pytest.mark.slow
def test_tensor_parallel_trains_one_process_model(one: dict[str, Any], out: Path) -> None:
    """FSDP(tp=2) on 2 ranks is one data shard: token batches (equal and variable lengths) and
    a stream split by the topology's data shard train what one process trains; a copy the
    peers hold drifting on one rank is found."""
    ranks = launch(out, "tp", 2)
    for case in ("equal", "variable", "stream"):
        tp, alone = ranks[0][case], one[case]
        assert tp["steps"] == alone["steps"], case
        assert (params(alone) - INITIAL).abs().max() > 1e-3, case  # it trained
        torch.testing.assert_close(params(tp), params(alone), rtol=0, atol=1e-5, msg=case)
        assert [r[case]["shard"] for r in ranks] == [[0, 1, True], [0, 1, False]]
    assert one["equal"]["steps"] == 6  # 5 token batches of 8 per epoch, 2 per update
    for case in ("stream_by_rank", "stream_unsaid"):  # refused on every rank, before training
        assert all("trains on data shard 0 of 1" in r[case] for r in ranks), case
    assert [r["stream_by_rank"][:45] for r in ranks] == [
        "ShardedStream says it reads data shard 0 of 2",
        "ShardedStream says it reads data shard 1 of 2",
    ]
    assert "reads no data shard" in ranks[0]["stream_unsaid"]
    # rank 0's copy of a layer the plan leaves whole drifted: by default every rank raises
    # after the last update (before: the tensor-parallel peers' copies were not compared)
    for rank in ranks:
        assert rank["diverged"].startswith("parameter 'inp.weight' differs across ranks at step 6")


@pytest.mark.slow
def test_hsdp_trains_one_process_model(one: dict[str, Any], out: Path) -> None:
    """FSDP(replicate=2) on 4 ranks and DDP on 4 reach one process's parameters; replicate=3
    is refused alike on every rank before any mesh; check_sync_every compares the replica
    groups' shards and finds one rank's copy drifting."""
    ranks = launch(out, "hsdp", 4)
    assert len({r["bad"] for r in ranks}) == 1 and "FSDP(replicate=3)" in ranks[0]["bad"]
    assert "world has 4" in ranks[0]["bad"] and ranks[0]["meshes_made"] == 0
    alone = params(one["plain"])
    for run in ("hsdp", "ddp"):
        assert ranks[0][run]["steps"] == one["plain"]["steps"] == 6
        torch.testing.assert_close(params(ranks[0][run]), alone, rtol=0, atol=1e-5, msg=run)
    assert ranks[0]["hsdp"]["copies"] == [[0, 2], [1, 3]]
    assert [r["hsdp"]["shard"][0] for r in ranks] == [0, 1, 2, 3]
    # rank 0's copy drifted from rank 2's: every rank raises at the next check
    assert all("differs across ranks at step 3" in r["diverged"] for r in ranks)
    assert "{0: " in ranks[0]["diverged"] and ", 2: " in ranks[0]["diverged"]


@pytest.mark.long  # 8 ranks: a minute of CI's 20 (like the pipeline's 8-rank mesh)
def test_hsdp_with_tensor_parallel(one: dict[str, Any], out: Path) -> None:
    """FSDP(replicate=2, tp=2) on 8 ranks (a 3-D mesh): one process's parameters."""
    ranks = launch(out, "hsdp_tp", 8, timeout=400)
    run = ranks[0]["hsdp_tp"]
    assert run["steps"] == 6 and run["copies"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    torch.testing.assert_close(params(run), params(one["plain"]), rtol=0, atol=1e-5)
