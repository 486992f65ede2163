"""The Kubernetes and cloud recipes of docs/launchers.rst, run as written there: each recipe's
command, read from the doc, starts on two "nodes" on 127.0.0.1 with the environment its
launcher documents (addresses replaced by 127.0.0.1, ports by free ones), and every process
reports the ranks fastdist sees (tests/workers/launcher_worker.py --ranks-only). Last, the
SLURM section's torchrun recipe is signalled as SLURM would signal it."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from launch import REPO_ROOT, TESTS_DIR, Launch, free_port, run_together, run_torchrun
from workers.signal_worker import START

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


def test_torchrun_under_srun_passes_usr1_on_and_the_ranks_checkpoint_in_time(
    tmp_path: Path,
) -> None:
    """USR1 sent to torchrun's process (as srun passes on SLURM's ``--signal``), with the
    recipe's ``PET_SIGNALS_TO_HANDLE``: torchrun passes it on and kills the workers 30 s later;
    they agree on it within seconds though the next log step is minutes away
    (tests/workers/signal_worker.py), write a checkpoint, ask for the requeue and exit with 143."""
    export = line_starting(section("SLURM"), "export PET_SIGNALS_TO_HANDLE=")
    name, value = export.removeprefix("export ").split("=", 1)
    env = {name: value, "SLURM_JOB_ID": "4242"}  # a SLURM job: USR1 is its requeue signal
    sent: list[float] = []

    def signal_torchrun() -> None:
        started, deadline = tmp_path / "started", time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if started.exists():
            os.kill(int(started.read_text()), signal.SIGUSR1)
            sent.append(time.monotonic())

    signaller = threading.Thread(target=signal_torchrun, daemon=True)
    signaller.start()
    worker = TESTS_DIR / "workers" / "signal_worker.py"
    result = run_torchrun(worker, 2, [str(tmp_path)], timeout=150, env=env, check=False)
    signaller.join()
    assert sent, result.describe()
    seconds = time.monotonic() - sent[0]
    assert seconds < 15, f"{seconds:.1f} s from the signal to torchrun's exit"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    step = ranks[0]["step"]
    assert ranks == [{"exit_code": 143, "step": step}] * 2, result.describe()
    assert START <= step < START + 40, "stopped within 8 s of updates"
    manifest = json.loads((tmp_path / "save" / "checkpoints" / "manifest.json").read_text())
    assert [entry["step"] for entry in manifest] == [step]
    assert (tmp_path / "save" / "checkpoints" / manifest[0]["file"]).is_file()
    assert "the requeue signal received; stopping at step" in result.output
    assert "scontrol requeue 4242" in result.output, "rank 0 asked SLURM for the requeue"
    assert "SIGKILL" not in result.output, result.describe()
    assert result.returncode == 1, "torchrun re-raises the signal it passed on"
