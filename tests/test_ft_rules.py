"""torchft replica groups (``DDP(fault_tolerant=True)``) held to their documented rules
(docs/reliability.rst, "Per-step fault tolerance (torchft)"; the defects of issue 33's audit):
the job's model and logged loss under a ``(sum, count)`` loss, lost samples counted per
group's real samples, refused options, and a group's position when it heals (it heals at its
start, adopting the peer's epoch, sampler and step, or stops; a group restarted after the
others finished does not train the job again alone).

Real replica groups: ``python -m fastdist ft`` (a torchft Lighthouse and one ``torchrun
--standalone`` per group, on 127.0.0.1) or a Lighthouse started here and stopped by its PID;
the worker ``tests/workers/ft_rules_worker.py`` (a float64 linear model on dict samples that
name themselves). The default tier starts its three runs together in one fixture; the slower
scenarios are in the long tier (``python -m pytest -m long tests/test_ft_rules.py``).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ft_runs import records, run_ft
from launch import TESTS_DIR, Launch, free_port, run_together, started
from torch.utils.data import IterableDataset

from fastdist import DistTrainer
from fastdist.cli import main as cli_main
from fastdist.cli.ft import wait_listening
from fastdist.strategies import DDP, FSDP, Pipeline
from fastdist.strategies.replica_groups import GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR

pytest.importorskip("torchft")

WORKER = TESTS_DIR / "workers" / "ft_rules_worker.py"


def _ft(out: Path, ft_args: list[str], worker_args: list[str], timeout: float = 240) -> Any:
    """This file's worker under ``fastdist ft`` (:func:`ft_runs.run_ft`); records by
    ``group<G>.attempt<A>``."""
    return run_ft(WORKER, out, ft_args, worker_args, timeout)


def _plain(out: Path, worker_args: list[str]) -> dict[str, Any]:
    """One plain process with update_every x 2: what 2 groups without failures must equal."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(WORKER), str(out), "--plain", *worker_args]
    (result,) = run_together([Launch(cmd)], 120)
    assert result.returncode == 0, result.describe()
    return records(out)["group0.attempt0"]


def _flat(params: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for p in params for x in p], dtype=torch.float64)


# The default tier: three runs started together, and refusals checked in this process.


@pytest.fixture(scope="module")
def together(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Three runs started together, each group a process of its own under a Lighthouse
    started here (no torchrun: its start-up is most of a short run's time): ``ft``, 2 groups
    without failures under a ``(sum, count)`` loss, logging every 4 updates (2 epochs of 32
    samples, batch 2); ``plain``, the one process with ``update_every=2`` they must equal;
    ``alone``, group 0 of a job of 2 on 23 samples (batch 4) whose group 1 never comes. Each
    run's records by name."""
    out = tmp_path_factory.mktemp("ft-rules")
    for name in ("ft", "plain", "alone"):
        (out / name).mkdir()
    args = ["--token-loss", "--print-every", "4", "--samples", "32", "--pause", "0"]
    plain = Launch([sys.executable, str(WORKER), str(out / "plain"), "--plain", *args])
    lone = [sys.executable, str(WORKER), str(out / "alone"), "--samples", "23", "--batch", "4"]
    with _lighthouse(min_replicas=2) as both, _lighthouse() as one:
        groups = [
            Launch(
                [sys.executable, str(WORKER), str(out / "ft"), *args],
                {GROUP_VAR: str(g), GROUPS_VAR: "2", LIGHTHOUSE_VAR: both},
            )
            for g in (0, 1)
        ]
        env = {GROUP_VAR: "0", GROUPS_VAR: "2", LIGHTHOUSE_VAR: one}
        results = run_together([*groups, plain, Launch([*lone, "--pause", "0"], env)], 240)
    for result in results:
        assert result.returncode == 0, result.describe()[-6000:]
    return {name: records(out / name) for name in ("ft", "plain", "alone")}


@pytest.mark.slow
def test_a_token_loss_trains_as_one_process_and_logs_the_jobs_loss(
    together: dict[str, dict[str, Any]],
) -> None:
    """Under a ``(sum, count)`` loss, 2 groups without failures end with the parameters of one
    process with ``update_every=2`` (the gradient divided by the count over both groups, not
    each group's own), and both log the job's loss: the one process's, at every log step."""
    ft, plain = together["ft"], together["plain"]["group0.attempt0"]
    groups = [ft[f"group{g}.attempt0"] for g in (0, 1)]
    assert all(u["groups"] == 2 for u in groups[0]["updates"])  # no failure
    assert groups[0]["params"] == groups[1]["params"], "the groups diverged"
    assert torch.allclose(_flat(groups[0]["params"]), _flat(plain["params"]), atol=1e-9)

    def logged(run: dict[str, Any]) -> dict[int, float]:  # by the log step each loss is of
        return {u["loss_step"]: u["loss"] for u in run["updates"] if u["loss_step"]}

    expected = logged(plain)
    assert sorted(expected) == [4, 8, 12, 16], expected
    for g, run in enumerate(groups):
        got = logged(run)
        assert got == pytest.approx(expected, rel=1e-9), f"group {g}: {got} != {expected}"


@pytest.mark.slow
def test_lost_samples_count_the_absent_groups_samples_not_its_slots(
    together: dict[str, dict[str, Any]],
) -> None:
    """Group 0 of 2 trains 23 samples (batch 4) alone: the sampler gives it 12 samples (3
    batches) and group 1 11 (4, 4 and 3). Per epoch 12 trained + 11 lost = 23: group 1's last
    slot counts its 3 samples, not a full batch."""
    run = together["alone"]["group0.attempt0"]
    assert all(u["groups"] == 1 for u in run["updates"])  # group 0 alone throughout
    trained = [i for b in run["batches"] if not b["filler"] for i in b["batch"]]
    assert len(trained) == 2 * 12, trained  # 2 epochs of its 12 samples
    assert run["epochs"] == {"1": 11, "2": 11}, f"lost per epoch: {run['epochs']}"


def test_bad_replica_options_are_refused(
    monkeypatch: pytest.MonkeyPatch, no_dist_env: None
) -> None:
    """Before anything starts, naming the option and the fix: ``min_replicas`` above the
    groups (no update could commit) or without ``fault_tolerant``; a streaming ``train_data``
    under several groups; a strategy that is not fault tolerant launched as a group, and
    ``Pipeline`` with fault-tolerant stages; ``python -m fastdist ft`` with a heartbeat
    timeout of 0 or negative restarts."""
    for name, value in {GROUP_VAR: "0", GROUPS_VAR: "2", LIGHTHOUSE_VAR: "http://x:1"}.items():
        monkeypatch.setenv(name, value)
    words = "min_replicas=3\\) needs at least 3 replica groups, but FASTDIST_REPLICA_GROUPS=2"
    for strategy in (DDP, FSDP):
        with pytest.raises(ValueError, match=words):
            strategy(fault_tolerant=True, min_replicas=3)
        with pytest.raises(ValueError, match="set fault_tolerant=True as well"):
            strategy(min_replicas=2)

    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[Any]:
            return iter([(torch.zeros(2), torch.zeros(1))] * 8)

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="a streaming train_data .* is not supported"):
        DistTrainer(
            train_data=Stream(),
            model=model,
            loss=torch.nn.MSELoss(),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            strategy=DDP(fault_tolerant=True),
            device="cpu",
        )
    # Launched as one of 2 groups, a strategy that joins none would train the job alone
    # (audit 68: Pipeline with fault-tolerant stages ran as two independent jobs).
    for strategy in (DDP(), FSDP(), Pipeline(stages=2)):
        words = re.escape(f"strategy={strategy!r} does not join them")
        with pytest.raises(ValueError, match=words):
            DistTrainer(
                train_data=[(torch.zeros(2), torch.zeros(1))] * 8,
                model=model,
                loss=torch.nn.MSELoss(),
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                strategy=strategy,
                device="cpu",
            )
    for stage in (DDP(fault_tolerant=True), FSDP(fault_tolerant=True)):
        with pytest.raises(ValueError, match="fault_tolerant .torchft's replica groups. are not"):
            Pipeline(stages=2, stage_strategy=stage)
    for option, value in (("--heartbeat-timeout-ms", "0"), ("--max-restarts", "-1")):
        with pytest.raises(SystemExit, match=f"{option} {value}: need"):
            cli_main(["ft", option, value, "train.py"])


# 2. Wrong model, data trained twice: a group restarted after the others finished.


@pytest.mark.long
def test_a_group_restarted_after_the_others_finished_does_not_retrain_alone(
    tmp_path: Path,
) -> None:
    """Group 1 is SIGKILLed after the last update (16 of 16); torchrun restarts it after group
    0 has finished. Expected (reliability.rst: "A group that starts later than the others joins
    at their step, healed, and its slots before it count as lost"): it has nothing left to
    train, or it fails saying no live group can heal it. Found: the restarted group starts
    from step 0 with a fresh model, trains the whole job alone (16 more updates over every
    sample again), ends with other parameters than group 0, and the launch exits 0."""
    ft = ["--heartbeat-timeout-ms", "1000", "--max-restarts", "1"]
    result, runs = _ft(tmp_path, ft, ["--kill", "1", "16", "kill", "--epochs", "1"])
    assert runs["group0.attempt0"]["steps"] == 16, result.describe()
    # torchrun restarted group 1, which found no live group and stopped before training.
    assert "replica group 1 was restarted (attempt 2) but no live" in result.output
    assert result.returncode != 0
    alone = [
        u["step"]
        for name, run in runs.items()
        if name != "group1.attempt0"
        for u in run["updates"]
        if name.startswith("group1.")
    ]
    assert not alone, f"the restarted group trained updates {alone} after the job had ended"


# 3. Bad input taken: min_replicas above the number of groups.


@pytest.mark.long
def test_min_replicas_above_the_groups_is_refused(tmp_path: Path) -> None:
    """``DDP(fault_tolerant=True, min_replicas=3)`` in a job of 2 groups can never commit an
    update. Expected (the common rule; reliability.rst "Bad input"): a ValueError naming
    min_replicas and FASTDIST_REPLICA_GROUPS on every process, before training. Found:
    accepted; every update is skipped ("0 of 2 replica groups committed it"), the epoch's 64
    samples are all counted lost, ``train()`` returns 0 steps and the launch exits 0 with the
    initial model."""
    ft = ["--max-restarts", "0"]
    result, runs = _ft(tmp_path, ft, ["--min-replicas", "3", "--epochs", "1"], timeout=180)
    trained = {name: run.get("steps") for name, run in runs.items()}
    assert result.returncode != 0, f"exit 0 with updates trained per group: {trained}"
    assert "min_replicas" in result.output and "FASTDIST_REPLICA_GROUPS" in result.output


# 4. Options that break under fault_tolerant, with errors that name something else.


@pytest.mark.long
def test_token_budget_batches_train_under_replica_groups(tmp_path: Path) -> None:
    """``batch_sampler=TokenBatchSampler(...)`` (docs/concepts.rst, "Token-budget batches";
    not listed among what fault_tolerant refuses or leaves untested). Expected: it trains (or
    a clear refusal naming batch_sampler). Found: every group fails at its first update with
    ``IndexError: list index out of range`` in ``window_weights`` (fastdist/data/batches.py),
    and torchrun restarts it to fail again."""
    ft = ["--min-replicas", "2", "--max-restarts", "0"]
    result, runs = _ft(tmp_path, ft, ["--token-batches", "8", "--token-loss", "--epochs", "1"])
    assert "IndexError" not in result.output, result.describe()[-6000:]
    assert result.returncode == 0, result.describe()[-6000:]


@pytest.mark.long
def test_a_stream_is_refused_under_replica_groups(tmp_path: Path) -> None:
    """A streaming ``train_data`` (an ``IterableDataset``) under 2 groups: its readers agree
    within one group only, so it is refused on every group before any collective, naming the
    stream and the fix (it used to fail with an untrue "fewer items than its 2 readers")."""
    ft = ["--min-replicas", "2", "--max-restarts", "0"]
    args = ["--stream", "--samples", "23", "--batch", "4", "--epochs", "1"]
    result, runs = _ft(tmp_path, ft, args)
    assert result.returncode != 0
    assert "fewer items than its 2 readers" not in result.output, result.describe()[-6000:]
    assert result.output.count("a streaming train_data (an IterableDataset) is not") == 2
    assert not any(run["updates"] for run in runs.values())


# 5. Wrong model, extra updates: a whole-job restart whose groups resume from different steps.


@pytest.mark.long
def test_a_group_behind_that_heals_across_an_epoch_trains_the_job_once(tmp_path: Path) -> None:
    """Run 1 (2 epochs of 16 updates, a checkpoint every 4): group 1 dies at its first update
    and is not restarted; group 0 trains on alone to update 32 (its checkpoint). Run 2, the
    whole job restarted for 3 epochs (48 updates): group 0, slower to start (5 s), resumes from
    its step-32 checkpoint; group 1 (no checkpoint) starts from step 0 and trains alone
    meanwhile. Expected (reliability.rst: "A group that joins, or one behind the others,
    receives every part ... the trainer's position in the epoch"; "a group whose newest is
    older then heals from one ahead"): group 1 heals at step 32 and both end at update 48 with
    the same parameters. Found: group 1 heals to step 32 but stays in the epoch it was in
    (it labels update 33 epoch 2 where group 0 is in epoch 3), trains past the job's 48
    updates (to 73, the last 25 alone, after group 0 ended), writes checkpoints of steps 72
    and 73, and ends with other parameters; the launch exits 0. Since the second audit, a
    group's start waits (up to the trainer's timeout) for the job's other groups: group
    1 waits for group 0 and heals at its start, at group 0's position, instead of training
    alone, falling behind and stopping to be restarted."""
    save = str(tmp_path / "save")
    ft = ["--heartbeat-timeout-ms", "1000"]
    first = ["--epochs", "2", "--ckpt-every", "4", "--save-path", save]
    _ft(tmp_path / "first", [*ft, "--max-restarts", "0"], [*first, "--kill", "1", "1", "kill"])
    assert (Path(save) / "replica_group0" / "checkpoints" / "step-00000032.pt").exists()
    second = ["--epochs", "3", "--ckpt-every", "4", "--save-path", save, "--alone-pause", "1"]
    result, runs = _ft(tmp_path / "second", ft, [*second, "--start-delay", "0", "5"])
    assert result.returncode == 0, result.describe()[-6000:]
    ahead, behind = runs["group0.attempt0"], runs["group1.attempt0"]
    assert "fell behind the other groups" not in result.output, result.describe()[-6000:]
    assert ahead["steps"] == 48, result.describe()[-6000:]
    epochs = {u["step"]: u["epoch"] for u in ahead["updates"]}
    wrong = [
        (u["step"], u["epoch"])
        for u in behind["updates"]
        if u["step"] in epochs and u["epoch"] != epochs[u["step"]]
    ]
    assert behind["steps"] == ahead["steps"], f"group 1 trained to update {behind['steps']}"
    assert not wrong, f"group 1's (update, epoch) where group 0's epoch differs: {wrong}"
    assert behind["params"] == ahead["params"]


@contextlib.contextmanager
def _lighthouse(min_replicas: int = 1) -> Iterator[str]:
    """A torchft Lighthouse on a free port, stopped by its PID."""
    port = free_port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    cmd = [str(binary), f"--min_replicas={min_replicas}", f"--bind=[::]:{port}"]
    cmd += ["--join_timeout_ms=1000", "--quorum_tick_ms=100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, proc, 30.0)  # before the next free_port() (it may pick this one)
        yield f"http://localhost:{port}"
    finally:
        proc.kill()
        proc.wait()


# 9. The Lighthouse restarted within the timeout (reliability.rst: "untested").


@pytest.mark.long
def test_a_restarted_lighthouse_recovers_or_fails_clearly(tmp_path: Path) -> None:
    """2 groups train (min_replicas 1); after 20 updates the Lighthouse is killed and started
    again on the same port 2 s later. Expected (reliability.rst: "a clear error or recovery,
    never a hang or silent divergence"): both groups finish with equal parameters, or both fail
    naming the Lighthouse, within the timeout."""
    port = free_port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    cmd = [str(binary), "--min_replicas=1", f"--bind=[::]:{port}", "--join_timeout_ms=1000"]
    cmd += ["--heartbeat_timeout_ms=1000"]
    env = {"FASTDIST_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
    worker = [sys.executable, str(WORKER), str(tmp_path), "--epochs", "4", "--pause", "0.1"]
    lighthouse = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first, second = (Launch(worker, {**env, "FASTDIST_REPLICA_GROUP": g}) for g in "01")
        with (
            started(first, tmp_path / "0.log") as a,
            started(second, tmp_path / "1.log") as b,
        ):
            log = tmp_path / "group0.attempt0.jsonl"
            deadline = time.monotonic() + 120
            while sum('"groups"' in line for line in _lines(log)) < 20:
                assert time.monotonic() < deadline, a.output()
                time.sleep(0.2)
            lighthouse.kill()
            lighthouse.wait()
            time.sleep(2)
            lighthouse = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            codes = []
            for group in (a, b):
                try:
                    codes.append(group.proc.wait(timeout=120))
                except subprocess.TimeoutExpired:
                    pytest.fail(f"a group hung after the Lighthouse restart:\n{group.output()}")
    finally:
        lighthouse.kill()
        lighthouse.wait()
    runs = records(tmp_path)
    if codes == [0, 0]:
        assert runs["group0.attempt0"]["params"] == runs["group1.attempt0"]["params"]
    else:
        for group in (a, b):
            assert "Lighthouse" in group.output(), group.output()[-3000:]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
