"""Per-step fault tolerance on torchft (``DDP``/``FSDP(fault_tolerant=True)``), with real
processes.

One launch of ``python -m fastdist ft`` (a Lighthouse and 2 replica groups of one process, on
127.0.0.1) in which group 1 SIGKILLs itself after a seeded update: group 0 trains on alone,
torchrun restarts group 1, which heals from group 0 and trains to the end with it. Then bad
input, in process: no Lighthouse, missing launch variables, the words naming a model
difference. A second launch: 2 groups of 2 processes under FSDP(fault_tolerant=True), group 1
killed and healed rank by rank. In the long tier: a replica index used twice (two processes,
the Lighthouse started here and stopped by PID), groups whose models or sizes differ, 2 groups of 2
processes under DDP, a Lighthouse lost or restarted, a SLURM-requeued group with no live
peer. The long tier also kills a group while it heals, and finds groups apart with
check_sync_every.
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import TESTS_DIR, Launch, free_port, run_together, started
from torch.utils.data import TensorDataset

from fastdist import DistTrainer
from fastdist.cli.ft import wait_listening
from fastdist.strategies import DDP, FSDP
from fastdist.strategies.replica_groups import GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR
from fastdist.strategies.same_model import differences, signature

pytest.importorskip("torchft")

WORKER = TESTS_DIR / "workers" / "ft_worker.py"
KILL_STEP = random.Random(33).randint(6, 10)  # seeded: the same update on every run
SAMPLES = 64  # ft_worker's dataset
BATCH = 2  # per group and update
PRINT_EVERY = 2  # the killed group heals at update 38 (48 - 10, see ft_worker): a log step


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two runs started together (each mostly waits: for a restart, on the survivor's slowed
    updates): 2 groups of one process under DDP, and 2 groups of 2 processes under
    FSDP(fault_tolerant=True); in each, group 1 (every rank of it) killed after KILL_STEP."""
    single, double = tmp_path_factory.mktemp("ft-killed"), tmp_path_factory.mktemp("ft-2x2")
    launches = [
        _kill_launch(single, "--print-every", str(PRINT_EVERY)),
        _kill_launch(double, "--fsdp", "--epochs", "5", procs=2),
    ]
    results = run_together(launches, timeout=200)
    return [_records(out, result) for out, result in zip((single, double), results, strict=True)]


@pytest.fixture(scope="module")
def killed(killed_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of groups of one process in which group 1 was killed after KILL_STEP."""
    return killed_runs[0]


@pytest.fixture(scope="module")
def killed_2x2(killed_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of 2 groups of 2 processes under FSDP(fault_tolerant=True)."""
    return killed_runs[1]


def _killed_run(out: Path, *args: str, restarts: int = 1, procs: int = 1) -> dict[str, Any]:
    """Run 2 groups of ``procs`` processes, group 1 killed at KILL_STEP (see :func:`_records`)."""
    (result,) = run_together([_kill_launch(out, *args, restarts=restarts, procs=procs)], 200)
    return _records(out, result)


def _kill_launch(out: Path, *args: str, restarts: int = 1, procs: int = 1) -> Launch:
    """``python -m fastdist ft`` of 2 groups of ``procs`` processes, group 1 killed at
    KILL_STEP, torchrun restarting each group up to ``restarts`` times."""
    cli = [sys.executable, "-m", "fastdist", "ft", "--groups", "2"]
    cli += ["--max-restarts", str(restarts), "--procs-per-group", str(procs)]
    cli += ["--heartbeat-timeout-ms", "1000", str(WORKER), "--", str(out), "1", str(KILL_STEP)]
    return Launch([*cli, *args])


def _records(out: Path, result: Any) -> dict[str, Any]:
    """Each attempt's updates, as committed (``<name>.jsonl``), and its end (``<name>.json``;
    a killed attempt has none); rank R > 0 of a group under ``<name>.rankR``."""
    assert result.returncode == 0, result.describe()
    records: dict[str, Any] = {"output": result.output}
    for path in out.glob("*.jsonl"):
        records[path.stem] = {"updates": [json.loads(line) for line in path.open()]}
    for path in out.glob("*.json"):
        records[path.stem].update(json.loads(path.read_text()))
    return records


@pytest.mark.slow
def test_survivor_never_stops_and_the_killed_group_heals(killed: dict[str, Any]) -> None:
    output = killed["output"]
    # Group 1's first attempt died at KILL_STEP (no end record); group 0 ran once, to the end.
    assert set(killed) == {"group0.attempt0", "group1.attempt0", "group1.attempt1", "output"}
    assert "params" not in killed["group1.attempt0"]
    died = killed["group1.attempt0"]["updates"][-1]["step"]
    assert died == KILL_STEP, output
    alive, healed = killed["group0.attempt0"], killed["group1.attempt1"]
    steps = [u["step"] for u in alive["updates"]]
    assert steps == list(range(steps[0], alive["steps"] + 1)), output  # its count went on
    groups = [u["groups"] for u in alive["updates"]]
    alone = [i for i, g in enumerate(groups) if g == 1 and steps[i] > KILL_STEP]
    assert alone, f"group 0 never trained alone after the kill: {groups}\n{output}"
    assert 2 in groups[alone[-1] :], f"group 1 never rejoined: {groups}\n{output}"
    ups = alive["updates"]
    gaps = [b["t"] - a["t"] - b["waited"] for a, b in zip(ups, ups[1:], strict=False)]
    assert max(gaps) < 15, "group 0 stalled"  # its own waits for group 1's restart left out
    # The restarted group healed from group 0 (no disk checkpoint: none was written).
    healed_steps = [u["step"] for u in healed["updates"]]
    assert healed_steps[0] > KILL_STEP + 1, healed_steps
    assert healed_steps == list(range(healed_steps[0], alive["steps"] + 1))
    assert f"resumed from a peer replica group at step {healed_steps[0] - 1}" in output
    assert healed["params"] == alive["params"]  # bit for bit: the same averaged gradients
    # It healed at a log step, which every group read at once (its loss averaged over the
    # groups of that update: a group healing at the next update's quorum joins no read).
    assert (healed_steps[0] - 1) % PRINT_EVERY == 0, healed_steps
    for group in (alive, healed):
        logged = [u for u in group["updates"] if u["step"] % PRINT_EVERY == 0]
        assert logged and all(u["loss_step"] == u["step"] for u in logged), output


@pytest.mark.slow
def test_every_sample_is_trained_or_counted_lost(killed: dict[str, Any]) -> None:
    """The rule: each epoch's samples went into a committed update, or are counted lost."""
    _check_accounting(killed)


@pytest.mark.long
def test_a_kill_inside_an_update_loses_it_on_every_group(tmp_path: Path) -> None:
    """Group 1 dies before update KILL_STEP's all-reduce: group 0's fails, torchft commits
    it nowhere, and its slot's samples count as lost; then as after a kill between updates."""
    run = _killed_run(tmp_path, "--in-backward")
    alive = run["group0.attempt0"]
    assert alive["skipped"] >= 1, run["output"]  # the update no group committed
    assert run["group1.attempt1"]["params"] == alive["params"]
    _check_accounting(run)


@pytest.mark.long
def test_a_kill_while_healing_recovers_and_check_sync_agrees(tmp_path: Path) -> None:
    """Group 1, killed at KILL_STEP, is killed again while it loads group 0's state (its
    second attempt): group 0 trains on; the third attempt heals and trains to the end with
    it, and check_sync_every (every 2 updates, across the groups) finds them equal."""
    run = _killed_run(tmp_path, "--kill-healing", "--epochs", "6", "--check-sync", "2", restarts=2)
    output = run["output"]
    assert "params" not in run["group1.attempt0"], output  # killed at KILL_STEP or later
    # It died while it loaded the peer's state (no disk checkpoint: it was healing).
    assert run["group1.attempt1"] == {"updates": [{"healing": True}]}, output
    alive, healed = run["group0.attempt0"], run["group1.attempt2"]
    steps = [u["step"] for u in alive["updates"]]
    assert steps == list(range(steps[0], alive["steps"] + 1)), output  # it never stopped
    healed_steps = [u["step"] for u in healed["updates"]]
    assert healed_steps == list(range(healed_steps[0], alive["steps"] + 1)), output
    assert sum(u["groups"] == 2 for u in healed["updates"]) >= 2, output  # checked together
    assert healed["params"] == alive["params"]
    assert "parameters differ" not in output


@pytest.mark.long
def test_check_sync_every_finds_groups_apart_on_every_group(tmp_path: Path) -> None:
    """Group 1 changes its model after update 3 (as a callback on one group could):
    check_sync_every 2 stops both groups at update 4, each naming it (before: each group
    compared its own process only, and they trained on apart). In groups of 2 processes where
    rank 0 of group 1 alone changes it, all 4 processes raise that error (before: the rank 1s
    failed in a broken collective instead)."""
    cli = [sys.executable, "-m", "fastdist", "ft", "--groups", "2", "--min-replicas", "2"]
    cli += ["--max-restarts", "0"]

    def launch(out: Path, procs: int, *extra: str) -> Launch:
        out.mkdir()
        args = [str(WORKER), "--", str(out), "--check-sync", "2", "--nudge", "3", *extra]
        return Launch([*cli, "--procs-per-group", str(procs), *args])

    launches = [launch(tmp_path / "1", 1), launch(tmp_path / "2", 2, "--nudge-rank", "0")]
    for result, processes in zip(run_together(launches, 150), (2, 4), strict=True):
        assert result.returncode != 0, result.describe()
        lines = result.output.splitlines()
        errors = [line for line in lines if line.startswith("RuntimeError")]
        assert len(errors) == processes, result.describe()
        assert all("the replica groups' parameters differ after update 4" in e for e in errors)


def _check_accounting(run: dict[str, Any], per_update: int = BATCH) -> None:
    """Each epoch's samples: in an update some group committed (``per_update`` samples
    each), or counted lost."""
    updates = {}  # step -> the update, as any group that committed it recorded it
    for name in ("group0.attempt0", "group1.attempt0", "group1.attempt1"):
        updates.update({u["step"]: u for u in run[name]["updates"]})
    alive = run["group0.attempt0"]
    assert sorted(updates) == list(range(1, alive["steps"] + 1))
    for epoch, counts in alive["epochs"].items():
        trained = sum(
            u["groups"] * per_update for u in updates.values() if u["epoch"] == int(epoch)
        )
        assert trained + counts["lost"] == SAMPLES, (epoch, trained, counts)
    assert sum(c["lost"] for c in alive["epochs"].values()) > 0
    assert "samples lost" in run["output"]


@contextlib.contextmanager
def _lighthouse(
    min_replicas: int, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A torchft Lighthouse on ``port`` (default a free one), listening: its URL and
    process, stopped by its PID."""
    port = port or free_port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    proc = subprocess.Popen(
        [str(binary), f"--min_replicas={min_replicas}", f"--bind=[::]:{port}"]
        + ["--join_timeout_ms=1000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_listening(port, proc, 30.0)  # the groups check it answers at their start
        yield f"http://localhost:{port}", proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """A torchft Lighthouse for 2 groups."""
    with _lighthouse(min_replicas=2) as (url, _):
        yield url


@pytest.mark.long
def test_a_replica_index_used_twice_fails_on_both(lighthouse: str, tmp_path: Path) -> None:
    twice = {GROUP_VAR: "0", GROUPS_VAR: "2", LIGHTHOUSE_VAR: lighthouse}
    cmd = [sys.executable, str(WORKER), str(tmp_path)]
    for result in run_together([Launch(cmd, twice), Launch(cmd, twice)], 120):
        assert result.returncode != 0
        assert "FASTDIST_REPLICA_GROUP [0] is used by more than one" in result.output, (
            result.describe()
        )


@pytest.mark.long
def test_groups_of_different_sizes_fail_clearly(lighthouse: str, tmp_path: Path) -> None:
    """Group 0 of 2 processes, group 1 of 1 (torchft pairs ranks one to one): both groups
    fail at their first quorum, naming the sizes, instead of timing out on the unpaired rank."""
    launches = []
    for group, procs in enumerate((2, 1)):
        env = {GROUP_VAR: str(group), GROUPS_VAR: "2", LIGHTHOUSE_VAR: lighthouse}
        env["FT_PROCESSES"] = "3"  # the worker waits for every process before its first quorum
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}"]
        torchrun += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        launches.append(Launch([*torchrun, str(WORKER), str(tmp_path)], env))
    results = run_together(launches, 150)
    for result in results:
        assert result.returncode != 0, "\n".join(r.describe() for r in results)
        assert "replica groups have different numbers of processes (group 0: 2, group 1: 1)" in (
            result.output
        ), "\n".join(r.describe() for r in results)
    assert not list(tmp_path.glob("*.json")), "a group trained to the end"


@pytest.mark.long
def test_a_requeued_slurm_group_with_no_live_peer_stops(tmp_path: Path) -> None:
    """A group that SLURM requeued (``SLURM_RESTART_COUNT=1``) after the other groups finished
    finds no live group to heal from: it stops before training instead of training the job
    again alone (as a group torchrun restarted does: test_ft_rules)."""
    with _lighthouse(min_replicas=1) as (url, _):
        env = {GROUP_VAR: "1", GROUPS_VAR: "2", LIGHTHOUSE_VAR: url, "SLURM_RESTART_COUNT": "1"}
        env["FT_PROCESSES"] = "1"
        (result,) = run_together([Launch([sys.executable, str(WORKER), str(tmp_path)], env)], 120)
    assert result.returncode != 0, result.describe()
    assert "replica group 1 was restarted (attempt 2) but no live replica group" in result.output
    assert not list(tmp_path.glob("*.json")), "the requeued group trained"


@pytest.mark.slow
def test_fsdp_groups_of_two_heal_rank_by_rank(killed_2x2: dict[str, Any]) -> None:
    """2 groups x 2 processes, FSDP within a group, torchft across: group 1 (both ranks)
    killed at KILL_STEP; group 0 never stops, group 1 restarts and each of its ranks heals
    its own shards from the same rank of group 0; all end with equal parameters, and every
    sample is trained or counted lost."""
    run, output = killed_2x2, killed_2x2["output"]
    _check_survivor_and_healed(run)
    for rank in ("", ".rank1"):  # each rank: its shards equal the same rank's of group 0
        alive, healed = run[f"group0.attempt0{rank}"], run[f"group1.attempt1{rank}"]
        assert healed["shards"] == alive["shards"], output
        assert healed["params"] == alive["params"], output
        assert [u["step"] for u in healed["updates"]] == [
            u["step"] for u in run["group1.attempt1"]["updates"]
        ]  # the group's ranks healed to the same step
    assert run["group0.attempt0"]["shards"] != run["group0.attempt0.rank1"]["shards"]
    _check_accounting(run, per_update=4)


@pytest.mark.long
def test_ddp_groups_of_two_heal(tmp_path: Path) -> None:
    """2 groups x 2 processes under DDP(fault_tolerant=True) (DDP within a group, its
    averaged gradients averaged across the groups): as above."""
    run = _killed_run(tmp_path, "--epochs", "5", procs=2)
    _check_survivor_and_healed(run)
    assert run["group1.attempt1.rank1"]["params"] == run["group0.attempt0"]["params"]
    _check_accounting(run, per_update=4)


def _check_survivor_and_healed(run: dict[str, Any]) -> None:
    """Group 0 never stopped and its count went on; group 1's second attempt healed from it
    past KILL_STEP and ended with its parameters."""
    output = run["output"]
    assert "params" not in run["group1.attempt0"], output
    assert run["group1.attempt0"]["updates"][-1]["step"] == KILL_STEP, output
    alive, healed = run["group0.attempt0"], run["group1.attempt1"]
    steps = [u["step"] for u in alive["updates"]]
    assert steps == list(range(1, alive["steps"] + 1)), output
    groups = [u["groups"] for u in alive["updates"]]
    assert 1 in groups[KILL_STEP:] and groups[-1] == 2, f"{groups}\n{output}"
    healed_steps = [u["step"] for u in healed["updates"]]
    assert healed_steps[0] > KILL_STEP + 1, healed_steps
    assert healed_steps == list(range(healed_steps[0], alive["steps"] + 1))
    assert healed["params"] == alive["params"]
    assert "samples lost" in output


@pytest.mark.long
@pytest.mark.parametrize("restart", [False, True], ids=["killed", "restarted"])
def test_a_lost_lighthouse_ends_every_group_clearly(restart: bool, tmp_path: Path) -> None:
    """The Lighthouse killed while 2 groups train: each fails within its timeout (30 s),
    naming the Lighthouse; none hangs. Also when a new Lighthouse starts on its port 1 s
    later: torchft 0.2.0 does not carry on (the new one numbers its quorums from 1 again,
    which the groups' Managers take for the quorum they hold, so none reconfigures its
    process group and their all-reduce waits for a peer that waits for a quorum)."""
    with contextlib.ExitStack() as stack, _lighthouse(min_replicas=1) as (url, lighthouse):
        cmd = [sys.executable, str(WORKER), str(tmp_path), "--epochs", "100"]
        env = {GROUP_VAR: "0", GROUPS_VAR: "2", LIGHTHOUSE_VAR: url}
        log = tmp_path / "group0.attempt0.jsonl"
        with (
            started(Launch(cmd, env), tmp_path / "0.log") as first,
            started(Launch(cmd, {**env, GROUP_VAR: "1"}), tmp_path / "1.log") as second,
        ):
            deadline = time.monotonic() + 120
            while not (log.exists() and len(log.read_text().splitlines()) >= 20):
                assert time.monotonic() < deadline, first.output()
                time.sleep(0.2)
            lighthouse.kill()
            killed_at = time.monotonic()
            if restart:
                time.sleep(1)
                stack.enter_context(_lighthouse(1, port=int(url.rsplit(":", 1)[1])))
            for group in (first, second):
                group.proc.wait(timeout=90)
                assert group.proc.returncode != 0
                assert "got no torchft quorum within 30 s" in group.output(), group.output()
            assert time.monotonic() - killed_at < 75


def test_no_lighthouse_is_named(monkeypatch: pytest.MonkeyPatch, no_dist_env: None) -> None:
    """One process is a whole replica group: its trainer refuses to start without one."""
    url = f"http://localhost:{free_port()}"
    for name, value in {GROUP_VAR: "0", GROUPS_VAR: "1", LIGHTHOUSE_VAR: url}.items():
        monkeypatch.setenv(name, value)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(RuntimeError, match=f"no torchft Lighthouse answers at {LIGHTHOUSE_VAR}"):
        DistTrainer(
            train_data=TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1)),
            model=model,
            loss=torch.nn.MSELoss(),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            strategy=DDP(fault_tolerant=True),
            device="cpu",
        )


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({GROUP_VAR: "0", LIGHTHOUSE_VAR: "http://x:1"}, "needs FASTDIST_REPLICA_GROUPS"),
        ({GROUP_VAR: "2", GROUPS_VAR: "2", LIGHTHOUSE_VAR: "http://x:1"}, "must be below"),
        ({GROUP_VAR: "0", GROUPS_VAR: "2"}, "needs TORCHFT_LIGHTHOUSE"),
    ],
)
def test_launch_variables_are_checked(
    env: dict[str, str], words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=words):
        DDP(fault_tolerant=True)
    with pytest.raises(ValueError, match=words):
        FSDP(fault_tolerant=True)
    with pytest.raises(ValueError, match="leave comm_hook and average_every unset"):
        DDP(fault_tolerant=True, comm_hook="fp16")
    for option in ({"replicate": 2}, {"tp": 2, "tp_plan": {"0": "colwise"}}):
        with pytest.raises(ValueError, match="leave replicate and tp at 1"):
            FSDP(fault_tolerant=True, **option)


def test_a_model_difference_is_named() -> None:
    """What every group's error says when the groups' models differ (the worlds: below)."""
    nn = torch.nn
    linear = signature(nn.Sequential(nn.Linear(4, 1)).state_dict())
    wider = signature(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)).state_dict())
    assert differences(wider, linear, "group 1", "group 0") == (
        "0.bias is (3,) torch.float32 in group 1 and (1,) torch.float32 in group 0, "
        "0.weight is (3, 4) torch.float32 in group 1 and (1, 4) torch.float32 in group 0, "
        "1.bias only in group 1, 1.weight only in group 1"
    )
    many = signature({f"w{i}": torch.zeros(i) for i in range(8)})
    assert differences(many, {}, "a", "b").endswith("w4 only in a (and 3 more)")


@pytest.mark.long
@pytest.mark.parametrize("how", ["wider", "renamed", "frozen"])
def test_a_mismatched_model_fails_every_group_alike(how: str, tmp_path: Path) -> None:
    """Group 1 builds another model (other shapes, the same shapes under other names, or
    frozen parameters): both groups fail at their first quorum together with one error
    naming the difference (before: group 1 failed alone loading group 0's state, trained on a
    renamed model, or, frozen, died in gloo while group 0 trained on alone)."""
    cli = [sys.executable, "-m", "fastdist", "ft", "--groups", "2", "--min-replicas", "2"]
    cli += ["--max-restarts", "0", str(WORKER), "--", str(tmp_path), "--odd-model", "1", how]
    (result,) = run_together([Launch(cli)], 150)
    assert result.returncode != 0, result.describe()
    expected = {
        "wider": "0.weight is (3, 4) torch.float32 in group 1 and (1, 4) torch.float32 in group 0",
        "renamed": "0.bias only in group 0, 0.weight only in group 0, 1.bias only in group 1",
        "frozen": "(frozen parameters) is 1 ['0.bias'] #",
    }[how]
    # One error from each group, the same (their tracebacks may interleave line by line).
    message = next(line for line in result.output.splitlines() if expected in line)
    message = message[message.index("replica groups build different models") :]
    assert result.output.count(message) == 2, result.describe()
    assert "every replica group must build the same model" in message
    assert not list(tmp_path.glob("*.json")), "a group trained to the end"


def _ft_run(out: Path, *args: str) -> dict[str, Any]:
    """``python -m fastdist ft`` of 2 groups that both must join (no update without both);
    group 0's end record."""
    out.mkdir()
    cli = [sys.executable, "-m", "fastdist", "ft", "--groups", "2", "--min-replicas", "2"]
    (result,) = run_together([Launch([*cli, str(WORKER), "--", str(out), *args])], 150)
    assert result.returncode == 0, result.describe()
    ends = [json.loads((out / f"group{g}.attempt0.json").read_text()) for g in (0, 1)]
    assert ends[0]["params"] == ends[1]["params"]
    return {**ends[0], "output": result.output}


@pytest.mark.long
def test_without_failures_two_groups_equal_one_process_and_disk_resume_works(
    tmp_path: Path,
) -> None:
    """2 groups x batch 2 equal 1 process x batch 2 x update_every 2 (no sample lost); a
    whole-job restart resumes each group from its own newest checkpoint on disk."""
    straight = _ft_run(tmp_path / "straight", "--epochs", "2")
    assert straight["epochs"] == {"1": {"lost": 0, "skipped": 0}, "2": {"lost": 0, "skipped": 0}}
    plain = tmp_path / "plain"
    plain.mkdir()
    cmd = [sys.executable, str(WORKER), str(plain), "--plain", "--epochs", "2"]
    (result,) = run_together([Launch(cmd)], 120)
    assert result.returncode == 0, result.describe()
    reference = json.loads((plain / "group0.attempt0.json").read_text())["params"]
    assert torch.allclose(_flat(straight["params"]), _flat(reference), atol=1e-6)
    save = str(tmp_path / "save")
    _ft_run(tmp_path / "first", "--epochs", "1", "--save-path", save)
    resumed = _ft_run(tmp_path / "resumed", "--epochs", "2", "--save-path", save)
    for group in (0, 1):
        assert f"replica_group{group}/checkpoints" in resumed["output"]
    assert resumed["params"] == straight["params"]


def _flat(params: list[Any]) -> torch.Tensor:
    return torch.cat([torch.tensor(p).flatten() for p in params])
