"""Several nodes on one machine: two torchrun "nodes", a simulated srun, shared storage checks.

Every layout of 2 processes must reach the parameters of one node with 2 processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launch import (
    Launch,
    Result,
    free_port,
    run_python,
    run_together,
    run_torchrun,
    torchrun_command,
)

from fastdist.distributed.slurm import first_host, torchrun_env_from_slurm

WORKER = Path(__file__).resolve().parent / "workers" / "multinode_worker.py"


def _two_nodes(out: Path, rendezvous: str, args: list[str], cwds: list[Path]) -> list[Result]:
    port = free_port()
    if rendezvous == "static":
        common = ["--nnodes=2", "--master-addr=127.0.0.1", f"--master-port={port}"]
        options = [[*common, f"--node-rank={node}"] for node in (0, 1)]
    else:
        common = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
        options = [[*common, "--rdzv-id=fastdist-test"] for _ in (0, 1)]
    launches = [
        Launch(torchrun_command(WORKER, 1, args, [*opts, "--max-restarts=0"]), cwd=cwd)
        for opts, cwd in zip(options, cwds, strict=True)
    ]
    return run_together(launches, timeout=180)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("one-node") / "params.json"
    run_torchrun(WORKER, nproc=2, args=[str(out)])
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes_match_one_node(rendezvous: str, one_node: list[float], tmp_path: Path) -> None:
    out = tmp_path / "params.json"
    results = _two_nodes(out, rendezvous, [str(out), "save"], [tmp_path, tmp_path])
    for result in results:
        assert result.returncode == 0, result.describe()
    assert json.loads(out.read_text()) == one_node
    output = "".join(r.output for r in results)
    assert "[rank 1 = node 1/0] finished on this rank" in output  # node/local rank tags
    assert (tmp_path / "save" / "log.jsonl").exists()  # written once, by global rank 0
    assert not list((tmp_path / "save").glob(".fastdist-probe-*"))


@pytest.mark.slow
def test_node_local_save_path_fails_before_training(tmp_path: Path) -> None:
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    out = tmp_path / "params.json"
    results = _two_nodes(out, "static", [str(out), "save"], cwds)  # relative: one per node
    for result in results:
        assert result.returncode != 0, result.describe()
        assert "directories that every rank must share are not shared" in result.output
        assert "save_path='save': rank" in result.output
        assert "loss" not in result.output  # no training started
    assert not out.exists()


@pytest.mark.slow
def test_srun_without_torchrun(one_node: list[float], tmp_path: Path) -> None:
    out = tmp_path / "params.json"
    slurm = {"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_NODEID": "0"}
    slurm["MASTER_PORT"] = str(free_port())
    launches = [
        Launch(
            [sys.executable, str(WORKER), str(out)],
            env=dict(slurm, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank)),
        )
        for rank in (0, 1)
    ]
    for result in run_together(launches, timeout=120):
        assert result.returncode == 0, result.describe()
        assert "[rank" in result.output  # a 2-process world, tagged
    assert json.loads(out.read_text()) == one_node


def test_first_host_of_a_slurm_node_list() -> None:
    assert first_host("gpu[03-05,09],cpu1") == "gpu03"
    assert first_host("node7") == "node7"
    assert first_host("a-b[010-011]") == "a-b010"


def test_slurm_variables_map_to_torchrun_ones() -> None:
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[03-04]",
    }
    assert torchrun_env_from_slurm(slurm) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu03",
        "MASTER_PORT": "29500",
    }
    assert torchrun_env_from_slurm(dict(slurm, RANK="0")) == {}  # srun torchrun: torchrun's
    assert torchrun_env_from_slurm({}) == {}


def test_one_plain_process_is_unaffected(tmp_path: Path) -> None:
    out = tmp_path / "params.json"
    run_python(WORKER, args=[str(out)])
    assert len(json.loads(out.read_text())) == 5
