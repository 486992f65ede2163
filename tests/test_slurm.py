"""SLURM for real: a one-node cluster on 127.0.0.1 (tests/slurm_cluster.py: Debian's munge and
slurm-wlm, started for this module and stopped by PID) runs launcher_worker.py with ``srun``,
one task per rank, and as an ``sbatch`` job that is signalled, checkpoints, requeues itself and
resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import slurm_cluster
import torch
from launch import REPO_ROOT, TESTS_DIR, TORCHRUN_VARS, free_port

from fastdist import DistTrainer
from fastdist.distributed.slurm import job_to_requeue, requeue_signal, torchrun_env_from_slurm
from fastdist.trainer.preemption import SigtermFlag

WORKER = TESTS_DIR / "workers" / "launcher_worker.py"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm_cluster.SlurmCluster]:
    """A SLURM cluster for this module. Skipped where SLURM is not installed, except in CI
    (``CI`` set), whose .ci/run installs it."""
    missing = slurm_cluster.missing_binaries()
    why = f"SLURM is not installed ({', '.join(missing)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        why = "the test cluster's daemons run as root (SlurmUser=root)"
    if missing or os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    cluster = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def job_env(cluster: slurm_cluster.SlurmCluster) -> dict[str, str]:
    """What srun and sbatch pass on to the tasks: no torchrun variables, the tests' imports,
    the CPU, a free rendezvous port (SLURM's variables say the rest)."""
    env = {k: v for k, v in cluster.env.items() if k not in TORCHRUN_VARS}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        MASTER_PORT=str(free_port()),
    )
    return env


def record(out: Path, attempt: int, rank: int) -> dict[str, Any]:
    return json.loads((out / f"{attempt}.rank{rank}.json").read_text())


def first_step(out: Path, attempt: int) -> int:
    line = (out / f"{attempt}.rank0.ids.jsonl").read_text().splitlines()[0]
    return int(json.loads(line)["step"])


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, signal.SIGUSR1),  # what #SBATCH --signal=B:USR1@90 sends
        ("USR2", signal.SIGUSR2),
        ("SIGUSR2", signal.SIGUSR2),
        (str(int(signal.SIGUSR2)), signal.SIGUSR2),
        ("none", None),
    ],
)
def test_the_requeue_signal_is_usr1_in_a_slurm_job_unless_named(
    given: str | None, expected: signal.Signals | None
) -> None:
    env = {"SLURM_JOB_ID": "7"} | ({} if given is None else {"FASTDIST_REQUEUE_SIGNAL": given})
    assert requeue_signal(env) == expected
    assert requeue_signal({"FASTDIST_REQUEUE_SIGNAL": "USR2"}) is None  # not a SLURM job


@pytest.mark.parametrize("given", ["TERM", "SIGKILL", "USR9", "999"])
def test_a_signal_that_cannot_requeue_is_refused_by_the_trainer_before_training(
    given: str, monkeypatch: pytest.MonkeyPatch, no_dist_env: None
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("FASTDIST_REQUEUE_SIGNAL", given)
    data = [(torch.zeros(2), 0)] * 4
    with pytest.raises(ValueError, match=f"FASTDIST_REQUEUE_SIGNAL='{given}' is not a signal"):
        DistTrainer(data, torch.nn.Linear(2, 2), device="cpu", use_tqdm=False)


def test_the_requeue_signal_sets_no_deadline_and_a_later_watch_times_sigterm_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("FASTDIST_REQUEUE_SIGNAL", raising=False)
    flag = SigtermFlag()
    with flag.watching():  # a first train(): USR1 noted, no deadline (the time limit bounds it)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.requeue and flag._deadline is None
    with flag.watching():  # a later train() of the same trainer: SIGTERM has its deadline
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag._deadline is not None and flag._deadline.is_alive()
    assert flag._deadline is None  # settled when training ends


TASK = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[3-4]"}


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"SLURM_NTASKS": "abc", "SLURM_PROCID": "0"},
            "SLURM_NTASKS='abc' is not an integer >= 1: it is SLURM's, so start the tasks with "
            "srun (which sets it), or unset SLURM_NTASKS when not under SLURM",
        ),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "-1"},
            "SLURM_PROCID='-1' is not an integer >= 0",
        ),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "2"},
            "SLURM_PROCID=2 but SLURM_NTASKS=2: a task's SLURM_PROCID must be below "
            "SLURM_NTASKS; start every task with one srun (srun -n 3 or more)",
        ),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_NODELIST": None},
            "SLURM_JOB_NODELIST is not set, so the address of task 0 is unknown: start the "
            "tasks with srun inside a job (which sets it), or set MASTER_ADDR to task 0's host",
        ),
        (
            {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "MASTER_PORT": "abc"},
            "MASTER_PORT='abc' is not a TCP port (an integer from 1 to 65535): set it to a free "
            "port on task 0's host, the same for every task, or unset it (default 29500)",
        ),
    ],
)
def test_slurm_variables_that_cannot_say_the_ranks_are_one_clear_error(
    given: dict[str, str | None], message: str
) -> None:
    env = {k: v for k, v in (TASK | given).items() if v is not None}
    with pytest.raises(ValueError) as raised:
        torchrun_env_from_slurm(env)
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_a_task_beyond_slurm_ntasks_fails_at_import_at_once(tmp_path: Path) -> None:
    """Before, it waited for peers that never come and failed with a generic error."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env |= TASK | {"SLURM_NTASKS": "2", "SLURM_PROCID": "2", "PYTHONPATH": str(REPO_ROOT)}
    script = "import fastdist, torch; fastdist.DistTrainer([(torch.zeros(2), 0)] * 4, torch.nn.Linear(2, 2))"  # noqa: E501
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: SLURM_PROCID=2 but SLURM_NTASKS=2"), done.stderr


def test_an_array_task_is_requeued_by_its_array_id() -> None:
    assert job_to_requeue({"SLURM_JOB_ID": "12"}) == "12"
    array = {"SLURM_JOB_ID": "15", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "3"}
    assert job_to_requeue(array) == "12_3"


@pytest.mark.slow
def test_srun_starts_a_task_per_rank_that_trains_as_torchrun_does(
    slurm: slurm_cluster.SlurmCluster, launcher_reference: list[float], tmp_path: Path
) -> None:
    env = job_env(slurm)
    cmd = ["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, str(WORKER), str(tmp_path)]
    done = run(cmd, env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr + slurm.logs()
    for rank in (0, 1):
        result = record(tmp_path, 0, rank)
        assert result["ranks"] == {
            "rank": rank,  # SLURM_PROCID
            "world_size": 2,  # SLURM_NTASKS
            "local_rank": rank,  # SLURM_LOCALID
            "local_world_size": 2,
            "node_rank": 0,  # SLURM_NODEID
        }
        assert result["params"] == launcher_reference
        assert result["master_probe_ran"] is (rank == 0)


JOB = """\
#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --signal=B:USR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={out}/job.out
# B: signals this shell alone: pass USR1 on to srun, which passes it on to every task.
srun {python} {worker} {out} --hold-at 5 &
srun_pid=$!
trap 'kill -USR1 $srun_pid' USR1
while true; do
    wait $srun_pid
    status=$?
    kill -0 $srun_pid 2>/dev/null || exit $status  # srun is done (not just the trap)
done
"""


@pytest.mark.slow
def test_a_signalled_sbatch_job_checkpoints_requeues_itself_and_resumes_exactly(
    slurm: slurm_cluster.SlurmCluster, launcher_reference: list[float], tmp_path: Path
) -> None:
    script = tmp_path / "job.sh"
    script.write_text(JOB.format(out=tmp_path, python=sys.executable, worker=WORKER))
    env = job_env(slurm)
    job = run(["sbatch", "--parsable", str(script)], env).stdout.strip()
    wait_until(lambda: (tmp_path / "held").exists(), 90, slurm, job, "update 5")
    # What SLURM sends --signal=B:USR1@90 seconds before the time limit.
    run(["scancel", "--batch", "--signal=USR1", job], env)
    time.sleep(1)
    (tmp_path / "go").touch()

    def requeued() -> bool:  # and its processes gone (COMPLETING until then)
        return slurm.job_field(job, "Restarts") == "1" and state() == "PENDING"

    def state() -> str:
        return slurm.job_field(job, "JobState")

    wait_until(requeued, 60, slurm, job, "the requeue")
    assert slurm.job_field(job, "Reason") == "BeginTime"  # SLURM holds a requeued job ~2 min
    # ... which this lifts, 2 s on: slurmd refuses a credential made within the second its
    # job's old one was revoked in ("Job credential revoked": the job then fails at once).
    time.sleep(2)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    wait_until(lambda: state() == "COMPLETED", 120, slurm, job, "the requeued job to complete")
    output = (tmp_path / "job.out").read_text()
    assert "requeued SLURM job" in output
    for rank in (0, 1):
        assert record(tmp_path, 0, rank)["exit_code"] == 143
        assert record(tmp_path, 1, rank)["params"] == launcher_reference
    # The signal rode the log step after it (6; every 2 updates), read after the next update:
    # the first run stopped at 7 with a checkpoint there; the requeued one resumed from it.
    assert first_step(tmp_path, 1) == 8
    assert "checkpoints/step-00000007.pt" in output


def wait_until(
    ready: Any, timeout: float, cluster: slurm_cluster.SlurmCluster, job: str, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            shown = cluster.run("scontrol", "show", "job", job, check=False)
            raise AssertionError(f"no {what} in {timeout} s\n{shown}\n{cluster.logs()}")
        time.sleep(0.2)


def run(
    cmd: list[str], env: dict[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """A SLURM client command, bounded in time."""
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
