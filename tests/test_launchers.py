"""The Kubernetes and cloud recipes of docs/launchers.rst, run as written there: each recipe's
command, read from the doc, starts on two "nodes" on 127.0.0.1 with the environment its
launcher documents (addresses replaced by 127.0.0.1, ports by free ones), and every process
reports the ranks fastdist sees (tests/workers/launcher_worker.py --ranks-only)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from launch import REPO_ROOT, TESTS_DIR, Launch, free_port, run_together

pytestmark = pytest.mark.slow

DOC = (REPO_ROOT / "docs" / "launchers.rst").read_text()
WORKER = TESTS_DIR / "workers" / "launcher_worker.py"


def section(title: str) -> str:
    """The text of docs/launchers.rst's section ``title``."""
    rest = DOC.split(f"\n{title}\n{'-' * len(title)}\n")[1]
    return re.split(r"\n\n[^\n]+\n-{3,}\n", rest)[0]  # up to the next title


def line_starting(text: str, start: str) -> str:
    return next(line.strip() for line in text.splitlines() if line.strip().startswith(start))


def run_nodes(script: str, envs: list[dict[str, str]], out: Path) -> list[dict[str, Any]]:
    """Run the shell ``script`` (with ``train.py`` standing for the worker) once per node
    environment; return what every rank saw, by rank."""
    script = script.replace("train.py", f"{WORKER} {out} --ranks-only")
    results = run_together([Launch(["bash", "-c", script], env) for env in envs], timeout=120)
    for result in results:
        assert result.returncode == 0, result.describe()
    return json.loads((out / "rank0.json").read_text())


def expected(nodes: int) -> list[dict[str, int]]:
    """One process per node: rank = node rank."""
    return [
        dict(rank=n, world_size=nodes, local_rank=0, local_world_size=1, node_rank=n)
        for n in range(nodes)
    ]


def test_kubeflow_pytorchjob(tmp_path: Path) -> None:
    args = line_starting(section("Kubeflow PyTorchJob"), "args:")
    (script,) = json.loads(args.removeprefix("args:").strip())
    port = str(free_port())
    pods = [  # master-0 and worker-0 of a job with nprocPerNode "1"
        dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(pod))
        | dict(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(pod))
        for pod in range(2)
    ]
    assert run_nodes(script, pods, tmp_path) == expected(2)


def test_torchx_dist_ddp(tmp_path: Path) -> None:
    command = line_starting(section("TorchX"), "torchrun ")
    command = command.replace(":29500", f":{free_port()}")
    command = command.replace("--nproc_per_node 8", "--nproc_per_node 1")
    replica = dict(TORCHX_RANK0_HOST="127.0.0.1", APP_ID="digits-1")
    seen = run_nodes(command, [replica, replica], tmp_path)
    # c10d gives node ranks in the order the nodes join: any order, each once.
    assert sorted(seen, key=lambda ranks: ranks["rank"]) == expected(2)


def test_skypilot(tmp_path: Path) -> None:
    run = section("SkyPilot").split("run: |")[1]
    script = "\n".join(line.strip() for line in run.strip().splitlines())
    script = re.sub(r"--master-port=\d+", f"--master-port={free_port()}", script)
    nodes = [
        dict(SKYPILOT_NODE_RANK=str(n), SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1")
        | dict(SKYPILOT_NUM_NODES="2", SKYPILOT_NUM_GPUS_PER_NODE="1")
        for n in range(2)
    ]
    assert run_nodes(script.replace(" --save-path /shared/digits", ""), nodes, tmp_path) == (
        expected(2)
    )
