"""Ray Train: an unchanged fastdist training function inside ``ray.train.torch.TorchTrainer`` on a
real local Ray cluster (4 CPUs, workers of 1 CPU over gloo), one per test module.

Each fit runs in a driver process of its own (tests/workers/ray_driver.py), bounded in time;
the training function is tests/workers/launcher_worker.py's, whose records these tests read.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from launch import REPO_ROOT, TESTS_DIR, TORCHRUN_VARS, run_python

if os.environ.get("CI"):  # CI installs .[dev], which has Ray: a missing Ray fails there
    import ray.train  # noqa: F401
else:
    pytest.importorskip("ray.train", reason="Ray Train is not installed: pip install fastdist[ray]")

pytestmark = pytest.mark.slow

N_SAMPLES = 72  # launcher_worker trains resume_worker's "plain" config: 72 samples, 2 epochs
# Rank 1 dies at update 5 of the first attempt, milliseconds after the report of checkpoint 4,
# which Ray registers too late: the restart must find it in the run's storage.
KILL_AT = 5


@pytest.fixture(scope="module")
def ray_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Start a local Ray cluster for this module (its head a child process of ours, stopped by
    closing its stdin, else killed by its process group); yield the environment of a driver:
    ``RAY_ADDRESS`` and the cluster's token."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    path = [str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")]
    cluster_env = {
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),  # Ray's token authentication, this cluster's
        "RAY_AUTH_MODE": "token",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray then keeps to 127.0.0.1
        # Ray Train's controller looks at its workers every 2 s by default: each fit waited
        # for that poll to see them start, end or die.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    }
    log = tmp_path_factory.mktemp("ray-head") / "head.log"
    with open(log, "wb") as err:
        head = subprocess.Popen(
            [sys.executable, str(TESTS_DIR / "workers" / "ray_head.py"), "4"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=dict(env, **cluster_env),
            start_new_session=True,
        )
    try:
        address = _read_address(head, log, timeout=120)
        yield dict(cluster_env, RAY_ADDRESS=address)
    finally:
        assert head.stdin is not None
        head.stdin.close()  # ray_head.py shuts the cluster down
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _read_address(head: subprocess.Popen[bytes], log: Path, timeout: float) -> str:
    assert head.stdout is not None
    ready, _, _ = select.select([head.stdout], [], [], timeout)
    line = head.stdout.readline().decode() if ready else ""
    if not line.startswith("address "):
        raise AssertionError(f"the Ray cluster did not start: {line!r}\n{log.read_text()[-4000:]}")
    return line.split()[1]


def fit(env: dict[str, str], out: Path, name: str, workers: int, *options: str) -> dict[str, Any]:
    """One ``TorchTrainer.fit()`` in a driver process; its report (see ray_driver.py)."""
    args = [env["RAY_ADDRESS"], str(out), name, "--workers", str(workers), *options]
    driver = TESTS_DIR / "workers" / "ray_driver.py"
    result = run_python(driver, args, timeout=150, env=env)
    report: dict[str, Any] = json.loads((out / f"{name}-{workers}.json").read_text())
    report["output"] = result.output
    return report


def record(out: Path, attempt: int, rank: int) -> dict[str, Any]:
    return json.loads((out / f"{attempt}.rank{rank}.json").read_text())


def updates(out: Path, attempt: int, rank: int) -> list[dict[str, Any]]:
    """The updates a rank trained in an attempt: ``{"epoch", "step", "ids"}`` each."""
    path = out / f"{attempt}.rank{rank}.ids.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_worker_killed_mid_run_is_restarted_by_ray_and_ends_as_an_uninterrupted_run(
    ray_env: dict[str, str], launcher_reference: list[float], tmp_path: Path
) -> None:
    report = fit(ray_env, tmp_path, "restart", 2, "--max-failures=1", f"--kill-at={KILL_AT}")
    assert report["error"] is None, report["output"]
    first, second = [record(tmp_path, 0, 0), record(tmp_path, 1, 0)]
    assert first["save_path"] != second["save_path"]  # a fresh node: nothing on its disk
    # The restart resumed from checkpoint 4, found in the run's storage though Ray had not
    # registered it, mid-epoch, and ended as torchrun's uninterrupted run does, bit for bit.
    assert [u["step"] for u in updates(tmp_path, 1, 0)][0] == 5
    for rank in (0, 1):
        restarted = record(tmp_path, 1, rank)
        assert restarted["params"] == launcher_reference
        # Ray formed the group; fastdist took every rank from Ray's context (Ray's exported
        # variables were removed), callbacks_master ran on Ray's world rank 0 alone.
        seen = restarted["ranks"]
        assert (
            seen.pop("ray")
            == seen
            == {
                "rank": rank,
                "world_size": 2,
                "local_rank": rank,
                "local_world_size": 2,
                "node_rank": 0,
            }
        )
        assert restarted["master_probe_ran"] is (rank == 0)
    # Every later checkpoint reached Ray with its metrics (4 did only if Ray registered it
    # before the worker died).
    assert [m["step"] for m in report["reported"] if m["step"] > 4] == [8, 9, 12, 16, 18]
    assert report["metrics"]["step"] == 18 and report["metrics"]["epoch"] == 2
    assert report["metrics"]["loss"] > 0
    assert report["checkpoint_files"] == ["manifest.json", "step-00000018.pt"]


@pytest.mark.long  # resuming on fewer processes: test_resume and test_matrix, without Ray
def test_a_run_restored_on_fewer_workers_trains_every_sample_once(
    ray_env: dict[str, str], tmp_path: Path
) -> None:
    failed = fit(ray_env, tmp_path, "resize", 2, "--max-failures=0", f"--kill-at={KILL_AT}")
    assert failed["error"] is not None, failed["output"]
    resized = fit(ray_env, tmp_path, "resize", 1)  # the same run, restored on 1 worker
    assert resized["error"] is None, resized["output"]
    assert "resuming a 2-process run on 1 processes" in resized["output"]
    before = [u for rank in (0, 1) for u in updates(tmp_path, 0, rank) if u["step"] <= 4]
    after = updates(tmp_path, 1, 0)
    assert after[0]["step"] == 5
    for epoch in (1, 2):
        ids = [i for u in before + after if u["epoch"] == epoch for i in u["ids"]]
        assert sorted(ids) == list(range(N_SAMPLES)), f"epoch {epoch}"
    # 4 updates of 8 samples, the other 40 of epoch 1 in 10 updates of 4, then 18 of 4.
    assert resized["metrics"]["step"] == 4 + 10 + 18


@pytest.mark.long  # the example on the cluster; CI's two Ray tests cover the same paths
def test_the_ray_example_reports_its_checkpoints_and_dev_metrics(
    ray_env: dict[str, str], tmp_path: Path
) -> None:
    args = ["--epochs=1", f"--storage={tmp_path / 'storage'}", f"--save-path={tmp_path / 'save'}"]
    args.append(f"--cache-dir={tmp_path / 'cache'}")
    result = run_python(REPO_ROOT / "examples" / "ray_train.py", args, timeout=150, env=ray_env)
    metrics = result.stdout.split("metrics ")[1].split("\n")[0]
    for key in ("'epoch': 1", "'dev/acc': ", "'best/acc': ", "'loss': "):
        assert key in metrics, result.output
    checkpoint = Path(result.stdout.split("checkpoint ")[1].split()[0])
    assert sorted(os.listdir(checkpoint)) == ["manifest.json", "step-00000024.pt"]
    assert (tmp_path / "save" / "checkpoints" / "step-00000024.pt").exists()  # and kept here
