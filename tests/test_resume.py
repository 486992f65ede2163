"""Checkpoints and exact resume: a run that dies, is restarted or pre-empted and resumed with
the same command ends with the parameters of a straight run, bit for bit.

Every run trains tests/workers/resume_worker.py's float64 MLP with dropout (so the random
generators must be restored), SGD with momentum (optimizer state) and a learning-rate callback
(callback state), on 72 samples in micro-batches of 4: 9 per rank and epoch on 2 ranks, 2 epochs.
The straight runs of every configuration are launched once per module, and CI's killed runs
(of different configurations) resume in one launch. Checkpoint files made wrong on disk
(corrupt shards, a broken manifest, a directory of another run's checkpoints, a truncated
newest checkpoint) are checked on 2 ranks by tests/workers/checkpoint_worker.py, in one launch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from launch import (
    Launch,
    Result,
    free_port,
    run_python,
    run_together,
    run_torchrun,
    torchrun_command,
)
from workers.resume_worker import CLASSES, HIDDEN, N_SAMPLES, build_trainer

from fastdist import Callback
from fastdist.checkpoint.lock import LOCK_FILE

WORKER = Path(__file__).resolve().parent / "workers" / "resume_worker.py"
CHECKPOINT_WORKER = WORKER.with_name("checkpoint_worker.py")
CONFIGS = "plain,accumulate,epoch-lr,fsdp,fsdp-exact,powersgd,local-sgd"  # resume_worker.CONFIGS
SIZE = 2  # processes of every torchrun launch

pytestmark = pytest.mark.slow


def launch(
    out: Path,
    configs: str,
    tag: str,
    *options: str,
    nproc: int = SIZE,
    check: bool = True,
) -> Result:
    """Run the worker under torchrun (``nproc`` > 1) or as one plain process."""
    args = [str(out), configs, "--tag", tag, *options]
    if nproc == 1:
        return run_python(WORKER, args, timeout=120, check=check)
    return run_torchrun(WORKER, nproc, args, timeout=120, check=check)


def rank_result(out: Path, config: str, tag: str, rank: int, restart: int = 0) -> dict[str, Any]:
    """What rank ``rank`` of attempt ``tag`` wrote when ``train()`` returned or exited."""
    path = out / config / f"{tag}-{restart}.rank{rank}.json"
    assert path.is_file(), f"{path.name} is missing"
    return json.loads(path.read_text())


def updates(out: Path, config: str, tag: str, rank: int, restart: int = 0) -> list[dict[str, Any]]:
    """The ``{"epoch", "step", "ids"}`` record of every update rank ``rank`` completed."""
    path = out / config / f"{tag}-{restart}.rank{rank}.ids.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def manifest_steps(out: Path, config: str) -> list[int]:
    """Steps of the checkpoints listed in ``config``'s manifest, oldest first."""
    manifest = json.loads((out / config / "checkpoints" / "manifest.json").read_text())
    for entry in manifest:
        assert (out / config / "checkpoints" / entry["file"]).exists(), entry  # file or dir
    return [entry["step"] for entry in manifest]


def checkpoint_path(out: Path, config: str, step: int) -> Path:
    return out / config / "checkpoints" / f"step-{step:08d}.pt"


def assert_same_params(got: list[float], expected: list[float], what: str) -> None:
    """Exact equality of two flat parameter lists, with the largest difference on failure."""
    if got != expected:
        diff = (torch.tensor(got) - torch.tensor(expected)).abs().max().item()
        pytest.fail(f"{what}: parameters differ from the straight run (max |diff| {diff:.3g})")


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of the straight (uninterrupted) run of every configuration."""
    out = tmp_path_factory.mktemp("straight")
    launch(out, CONFIGS, "straight")
    return out


def assert_matches_straight(
    straight: Path,
    out: Path,
    config: str,
    resumed: str,
    first: str | None = None,
    restart: int = 0,
) -> None:
    """Attempt ``resumed`` (restart ``restart``) ends with the straight run's parameters on
    every rank. With ``first`` (the attempt that died, restart 0), the updates it completed up
    to the resume point followed by the resumed attempt's must first be the straight run's:
    the same samples with the same loss, update by update."""
    resume_step = rank_result(out, config, resumed, 0, restart)["start_step"]
    for rank in range(SIZE):
        expected = rank_result(straight, config, "straight", rank)
        got = rank_result(out, config, resumed, rank, restart)
        assert got["start_step"] == resume_step and got["steps"] == expected["steps"]
        assert not got["rolled_back"], "a resume on as many processes is not a rollback"
        if first is not None:
            done = [u for u in updates(out, config, first, rank) if u["step"] <= resume_step]
            assert [u["step"] for u in done] == list(range(1, resume_step + 1))
            stream = done + updates(out, config, resumed, rank, restart)
            reference = updates(straight, config, "straight", rank)
            assert [u["step"] for u in stream] == [u["step"] for u in reference]
            for update, ref in zip(stream, reference, strict=True):
                where = f"rank {rank}, update {update['step']} (resumed after {resume_step})"
                assert update["ids"] == ref["ids"], f"{where}: other samples"
                assert update["loss"] == ref["loss"], f"{where}: same samples, another loss"
        assert_same_params(got["final"], expected["final"], f"rank {rank}")


# ----- killed and resumed with the same command -----

# config, kill_at, kill_how, resume_step of each kill: rank 1 dies before micro-batch kill_at,
# after the checkpoint of update resume_step.
KILLS = {
    # update_every=2: SIGKILL after micro-batch 5, the first of update 3's window; the
    # resumed run redoes that window from the checkpoint of update 2.
    "inside-update-window-sigkill": ("accumulate", 6, "sigkill", 2),
    # Dies before the first micro-batch of epoch 2: resumes from epoch 1's end.
    "epoch-boundary": ("plain", 10, "exit", 9),
    # The long tier's (in CI the cases above, the torchrun restarts and the matrix kill
    # mid-epoch). Rank 1 dies before micro-batch 6 of epoch 1; update 5 was checkpointed.
    "mid-epoch": ("plain", 6, "exit", 5),
    # PowerSGD has compressed updates 11-13 when rank 1 dies in update 14: every rank's
    # error feedback and Q matrices resume, re-laid out onto the new DDP's buckets.
    "powersgd-error-feedback": ("powersgd", 14, "sigkill", 13),
    # Local SGD averaged at update 12; ranks stepped on their own in update 13: each
    # rank's parameters and momentum resume.
    "local-sgd-per-rank-state": ("local-sgd", 14, "sigkill", 13),
}
CI_KILLS = ["inside-update-window-sigkill", "epoch-boundary"]  # of distinct configs


def kill(out: Path, case: str) -> None:
    """Launch ``case``'s kill: the job fails where it should, after the checkpoint of its
    resume step."""
    config, kill_at, kill_how, resume_step = KILLS[case]
    options = ["--kill-at", str(kill_at), "--kill-how", kill_how]
    first = launch(out, config, "first", *options, check=False)
    assert first.returncode != 0, first.describe()
    if kill_how == "sigkill":
        assert "Signal 9 (SIGKILL)" in first.output, first.describe()
    for rank in range(SIZE):
        assert not (out / config / f"first-0.rank{rank}.json").exists(), f"{case}: did not die"
    assert manifest_steps(out, config)[-1] == resume_step, case


def logged_losses(directory: Path) -> dict[int, float]:
    """The training losses ``log.jsonl`` holds by step, of the last attempt (the records after
    its last ``start``)."""
    records = [json.loads(line) for line in (directory / "log.jsonl").read_text().splitlines()]
    starts = [i for i, record in enumerate(records) if record["kind"] == "start"]
    return {r["step"]: r["loss"] for r in records[starts[-1] :] if r["kind"] == "train"}


def assert_resumed(straight: Path, out: Path, case: str, resumed: Result) -> None:
    """``case``'s config, resumed by ``resumed`` (the same command), ends as the straight run,
    and logs its losses: the first after the resume covers the updates the checkpoint
    followed since the last log step too."""
    config, _, _, resume_step = KILLS[case]
    assert f"resumed from {checkpoint_path(out, config, resume_step)}" in resumed.output
    assert rank_result(out, config, "resumed", 0)["start_step"] == resume_step
    assert_matches_straight(straight, out, config, "resumed", first="first")
    logged, reference = logged_losses(out / config), logged_losses(straight / config)
    assert logged and min(logged) > resume_step
    assert logged == pytest.approx({s: reference[s] for s in logged}, rel=1e-12, abs=0)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    """CI's kills, each launched, then one launch of their configs (the same command that
    resumes each in turn): its directory and that launch."""
    out = tmp_path_factory.mktemp("killed")
    for case in CI_KILLS:
        kill(out, case)
    return out, launch(out, ",".join(KILLS[case][0] for case in CI_KILLS), "resumed")


@pytest.mark.parametrize("case", CI_KILLS)
def test_killed_run_resumes_exactly(straight: Path, killed: tuple[Path, Result], case: str) -> None:
    out, resumed = killed
    assert_resumed(straight, out, case, resumed)


@pytest.mark.long
@pytest.mark.parametrize("case", [case for case in KILLS if case not in CI_KILLS])
def test_killed_run_resumes_exactly_long(straight: Path, tmp_path: Path, case: str) -> None:
    kill(tmp_path, case)
    resumed = launch(tmp_path, KILLS[case][0], "resumed")  # the same command, resume="auto"
    assert_resumed(straight, tmp_path, case, resumed)


def run_torchrun_with_restarts(
    args: list[str], max_restarts: int, timeout: float, rendezvous: str = "static"
) -> Result:
    """``torchrun --max-restarts=N`` (launch.run_torchrun always passes 0), with the static
    (torchrun's default) or the c10d rendezvous. Both keep one store across restarts; fastdist
    forms every restart's group under a prefix of its own, so no workaround is needed."""
    if rendezvous == "static":
        options = ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    else:
        options = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    options += ["--nnodes=1", f"--max-restarts={max_restarts}"]
    (result,) = run_together([Launch(torchrun_command(WORKER, SIZE, args, options))], timeout)
    return result


# static: the long tier (CI's matrix restarts its world under the static rendezvous).
@pytest.mark.parametrize("rendezvous", [pytest.param("static", marks=pytest.mark.long), "c10d"])
def test_torchrun_restart_resumes_exactly(straight: Path, tmp_path: Path, rendezvous: str) -> None:
    """``torchrun --max-restarts=1``: rank 1 dies in epoch 2 on the first attempt only; the
    restarted workers resume from update 12 and the job completes on its own."""
    args = [str(tmp_path), "plain", "--tag", "job", "--kill-at", "13"]
    result = run_torchrun_with_restarts(args, max_restarts=1, timeout=150, rendezvous=rendezvous)
    assert result.returncode == 0, result.describe()
    for rank in range(SIZE):
        assert not (tmp_path / "plain" / f"job-0.rank{rank}.json").exists(), "did not die"
    assert f"resumed from {checkpoint_path(tmp_path, 'plain', 12)}" in result.output
    assert rank_result(tmp_path, "plain", "job", 0, restart=1)["start_step"] == 12
    assert_matches_straight(straight, tmp_path, "plain", "job", first="job", restart=1)


def test_fsdp_restart_resumes_exactly_from_a_sharded_checkpoint(
    straight: Path, tmp_path: Path
) -> None:
    """strategy="fsdp", update_every=2: rank 1 dies before micro-batch 6 (inside update 3's
    window); torchrun restarts the job, which resumes from the DCP checkpoint of update 2,
    each rank reading its own shard, and ends with the straight run's shards bit for bit."""
    args = [str(tmp_path), "fsdp", "--tag", "job", "--kill-at", "6"]
    result = run_torchrun_with_restarts(args, max_restarts=1, timeout=150)
    assert result.returncode == 0, result.describe()
    checkpoints = tmp_path / "fsdp" / "checkpoints"
    assert f"resumed from {checkpoints / 'step-00000002'}:" in result.output, result.describe()
    newest = checkpoints / f"step-{manifest_steps(tmp_path, 'fsdp')[-1]:08d}"
    assert sorted(p.name for p in newest.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "trainer.pt",
    ]
    assert not list(checkpoints.glob(".tmp-*"))
    assert_matches_straight(straight, tmp_path, "fsdp", "job", first="job", restart=1)


def keep_until(checkpoints: Path, step: int) -> None:
    """Delete the checkpoints after update ``step``, files and manifest entries: as if the run
    had died after writing the checkpoint of ``step``."""
    manifest = checkpoints / "manifest.json"
    entries = json.loads(manifest.read_text())
    for entry in entries:
        if entry["step"] > step:
            shutil.rmtree(checkpoints / entry["file"])
    manifest.write_text(json.dumps([entry for entry in entries if entry["step"] <= step]))


def test_fsdp_checkpoint_of_two_ranks_resumes_on_one(straight: Path, tmp_path: Path) -> None:
    """DCP reshards 2 ranks' checkpoint of update 2 onto one process, which then ends with the
    parameters the 2 ranks ended with, to float64 rounding; a partial (unpublished) newer
    checkpoint is skipped.

    Why equal: rank r of 2 takes positions r, r + 2, ... of the epoch's order, so the 2
    micro-batches of 4 that each rank adds to an update (update_every=2) are 16 consecutive
    positions of it: those one process takes in 2 micro-batches of 8 (``--batch 8``), the same
    global batch. Every update averages the gradient of the same 16 samples (each micro-batch
    weighted by its share), the epochs have as many updates, so the learning rates match too.
    The model has no dropout (``fsdp-exact``): its masks come from each rank's own generator.
    Only the order of the sums differs.
    """
    shutil.copytree(straight / "fsdp-exact", tmp_path / "fsdp-exact")
    checkpoints = tmp_path / "fsdp-exact" / "checkpoints"
    keep_until(checkpoints, 2)
    (checkpoints / ".tmp-step-00000003").mkdir()  # as if the ranks died writing update 3's
    resumed = launch(tmp_path, "fsdp-exact", "resumed", "--batch", "8", nproc=1)
    assert "resuming a 2-process run on 1 processes" in resumed.output, resumed.describe()
    assert "global batch now 16" in resumed.output
    assert f"resumed from {checkpoints / 'step-00000002'}:" in resumed.output
    result = rank_result(tmp_path, "fsdp-exact", "resumed", 0)
    expected = [rank_result(straight, "fsdp-exact", "straight", rank) for rank in range(SIZE)]
    assert expected[0]["full"] == expected[1]["full"], "the gathered model differs by rank"
    assert (result["start_step"], result["world_size"]) == (2, 1)
    assert result["steps"] == expected[0]["steps"] == 10
    diff = (torch.tensor(result["final"]) - torch.tensor(expected[0]["full"])).abs().max()
    assert diff <= 1e-6, f"max |diff| {diff:.3g} from the 2-rank run's final parameters"


def test_two_ranks_resumed_on_one_process_see_each_sample_once(tmp_path: Path) -> None:
    """2 ranks stop after update 3 (24 samples of epoch 1); one plain process trains the other
    48: every sample of epoch 1 is trained on exactly once overall, and all of epoch 2."""
    first = launch(tmp_path, "plain", "first", "--kill-at", "4", check=False)
    assert first.returncode != 0, first.describe()
    resumed = launch(tmp_path, "plain", "resumed", nproc=1)
    assert "resuming a 2-process run on 1 processes" in resumed.output, resumed.describe()
    result = rank_result(tmp_path, "plain", "resumed", 0)
    assert (result["start_step"], result["world_size"]) == (3, 1)
    assert result["rolled_back"], "backends must not keep the killed run's steps after 3"
    assert result["steps"] == result["total_steps"] == 3 + 48 // 4 + N_SAMPLES // 4

    def seen(records: list[dict[str, Any]], epoch: int) -> list[int]:
        return [i for r in records if r["epoch"] == epoch for i in r["ids"]]

    # Only updates the checkpoint holds count (the resumed run restarts after step 3).
    before = [
        u for r in range(SIZE) for u in updates(tmp_path, "plain", "first", r) if u["step"] <= 3
    ]
    after = updates(tmp_path, "plain", "resumed", 0)
    epoch1 = seen(before, 1) + seen(after, 1)
    assert len(seen(before, 1)) == 24
    assert Counter(epoch1) == Counter(range(N_SAMPLES)), "epoch 1: some sample not seen once"
    assert Counter(seen(after, 2)) == Counter(range(N_SAMPLES)), "epoch 2"


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, with its bytes (not a run's lock)."""
    files = (path for path in directory.rglob("*") if path.is_file() and path.name != LOCK_FILE)
    return {str(path.relative_to(directory)): path.read_bytes() for path in files}


class Judged(NamedTuple):
    """The launch of :func:`judged`: its directory, its result, and what held before it."""

    out: Path
    result: Result
    held_before: dict[str, bytes]  # the files of the "fresh" case's checkpoint directory
    truncated_steps: list[int]  # the manifest's steps of the "truncated" case
    others: dict[str, tuple[Path, dict[str, bytes]]]  # "other-*" cases' checkpoints, files


@pytest.fixture(scope="module")
def judged(straight: Path, tmp_path_factory: pytest.TempPathFactory) -> Judged:
    """One 2-rank launch of tests/workers/checkpoint_worker.py over checkpoint files made
    wrong, in order: a finished run's directory (``fresh``), a missing file, a file that is no
    checkpoint, a manifest cut short, a shard with one byte flipped (named, then found by
    ``auto``), and a copy of the straight ``plain`` run whose newest checkpoint is cut short
    (``truncated``); then copies of finished runs resumed with another optimizer class
    (``other-optimizer``, DDP), an optimizer over fewer parameters (``other-groups``) or
    another model (``other-model``, FSDP)."""
    out = tmp_path_factory.mktemp("judged")
    source = straight / "fsdp-exact" / "checkpoints"

    def copy(name: str) -> Path:
        shutil.copytree(source, out / name / "checkpoints")
        return out / name / "checkpoints"

    held = copy("held")  # a finished run's checkpoints
    held_before = snapshot(held)
    (out / "garbage.pt").write_bytes(b"not a checkpoint")
    broken = out / "broken-manifest" / "checkpoints"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text('[{"file": "step-00000001", ')  # cut short
    corrupt = copy("corrupt")
    keep_until(corrupt, 3)
    shard = corrupt / "step-00000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped, as a bad disk does; the size stays
    shard.write_bytes(bytes(data))
    shutil.copytree(straight / "plain", out / "truncated" / "plain")
    truncated_steps = manifest_steps(out / "truncated", "plain")
    newest = checkpoint_path(out / "truncated", "plain", truncated_steps[-1])
    os.truncate(newest, newest.stat().st_size // 2)
    shutil.copytree(straight / "plain", out / "other-optimizer" / "plain")
    shutil.copytree(straight / "plain", out / "other-groups" / "plain")
    other_model = copy("other-model")
    other_optimizer = out / "other-optimizer" / "plain" / "checkpoints"
    other_groups = out / "other-groups" / "plain" / "checkpoints"
    others = {  # their checkpoints, to be left as they are
        name: (path, snapshot(path))
        for name, path in (
            ("other-optimizer", other_optimizer),
            ("other-groups", other_groups),
            ("other-model", other_model),
        )
    }
    cases = {
        "fresh": ("fsdp-exact", held.parent, False),
        "missing": ("fsdp-exact", out / "a", str(out / "nowhere" / "step-00000003")),
        "garbage": ("fsdp-exact", out / "b", str(out / "garbage.pt")),
        "manifest": ("fsdp-exact", broken.parent, "auto"),
        "named-shard": ("fsdp-exact", out / "c", str(corrupt / "step-00000003")),
        "auto-shard": ("fsdp-exact", corrupt.parent, "auto"),  # it trains, rewriting step 3
        "truncated": ("plain", out / "truncated" / "plain", "auto"),  # it trains the last update
        "other-optimizer": ("plain", out / "other-optimizer" / "plain", "auto"),
        "other-groups": ("plain", other_groups.parent, "auto"),
        "other-model": ("fsdp-exact", other_model.parent, "auto"),
    }
    spec = [
        {"name": name, "config": config, "save_path": str(path), "resume": resume}
        for name, (config, path, resume) in cases.items()
    ]
    spec[-3]["adamw"], spec[-2]["frozen"], spec[-1]["hidden"] = True, True, HIDDEN + 2
    (out / "cases.json").write_text(json.dumps(spec))
    result = run_torchrun(CHECKPOINT_WORKER, SIZE, [str(out / "cases.json"), str(out)])
    return Judged(out, result, held_before, truncated_steps, others)


def outcomes(out: Path, case: str) -> list[dict[str, Any]]:
    """What every rank of :func:`judged`'s launch wrote for ``case``."""
    return [json.loads((out / f"{case}.rank{rank}.json").read_text()) for rank in range(SIZE)]


def test_truncated_newest_checkpoint_falls_back_to_the_previous(
    straight: Path, judged: Judged
) -> None:
    """The newest checkpoint (epoch 2's end) is cut short: the run warns, resumes from the one
    before (update 17), trains the last update and still ends where the straight run did."""
    assert judged.truncated_steps[-2:] == [17, 18]
    newest = checkpoint_path(judged.out / "truncated", "plain", 18)
    assert re.search(
        rf"skipping checkpoint {re.escape(str(newest))}: .*CRC-32 does not match",
        judged.result.output,
    ), judged.result.describe()
    previous = checkpoint_path(judged.out / "truncated", "plain", 17)
    assert f"resumed from {previous}" in judged.result.output
    # The cut-short checkpoint is moved aside, not written over at update 18 and pruned.
    aside = re.search(
        rf"could not be resumed \({newest.name}\) were moved to (\S+):", judged.result.output
    )
    assert aside, judged.result.describe()
    moved = Path(aside.group(1)) / newest.name  # half the size of the one written anew
    assert 0 < 2 * moved.stat().st_size <= newest.stat().st_size, "not the cut-short file"
    got = outcomes(judged.out, "truncated")
    for rank in range(SIZE):  # as assert_matches_straight, from checkpoint_worker's records
        expected = rank_result(straight, "plain", "straight", rank)
        assert got[rank]["start_step"] == got[0]["start_step"] == 17
        assert got[rank]["steps"] == expected["steps"]
        assert not got[rank]["rolled_back"], "a resume on as many processes is not a rollback"
        assert_same_params(got[rank]["final"], expected["final"], f"rank {rank}")


def test_checkpoint_files_are_judged_alike_on_every_rank(straight: Path, judged: Judged) -> None:
    """2 ranks, one launch, resume=... with files made wrong as a disk or a user can: every rank
    raises the same error naming the file, before any collective (none hangs), or every rank
    skips the same checkpoint. Each rank checks every other file of a sharded checkpoint (by
    name: rank 1 checks ``__0_0.distcp``), so a shard that only rank 1 finds corrupt must make
    rank 0 skip it too."""
    out, result = judged.out, judged.result
    held = out / "held" / "checkpoints"
    missing = out / "nowhere" / "step-00000003"
    garbage = out / "garbage.pt"
    broken = out / "broken-manifest" / "checkpoints"
    corrupt = out / "corrupt" / "checkpoints"
    shard = corrupt / "step-00000003" / "__0_0.distcp"

    def error(case: str) -> str:
        ranks = outcomes(out, case)
        assert ranks[0] == ranks[1], f"{case}: the ranks disagree: {ranks}"
        return ranks[0]["error"]

    fresh = error("fresh")
    assert fresh.startswith(f"FileExistsError: the checkpoint directory '{held}' already holds")
    for fix in ("resume='auto'", "another save_path/checkpoint_dir", "delete the old checkpoints"):
        assert fix in fresh
    assert snapshot(held) == judged.held_before, "a refused run changed the checkpoints"
    assert error("missing").startswith(f"FileNotFoundError: resume='{missing}': no such")
    assert error("garbage").startswith(f"ValueError: resume='{garbage}' cannot be resumed")
    assert error("manifest").startswith(f"ValueError: {broken / 'manifest.json'} is not a")
    assert f"cannot be resumed from: {shard}: its CRC-32 does not match" in error("named-shard")

    skipped = f"skipping checkpoint {corrupt / 'step-00000003'}: {shard}: its CRC-32 does not"
    assert result.output.count(skipped) == 1, result.describe()  # rank 0 says it for both
    assert f"resumed from {corrupt / 'step-00000002'}:" in result.output
    for rank, got in enumerate(outcomes(out, "auto-shard")):
        assert got["start_step"] == 2
        expected = rank_result(straight, "fsdp-exact", "straight", rank)["final"]
        assert_same_params(got["final"], expected, f"rank {rank} after the fallback")


def test_another_optimizer_or_model_is_refused_before_anything_loads(judged: Judged) -> None:
    """A checkpoint resumed with another optimizer class (SGD's, by AdamW: it loaded, then
    failed at the first step; AdamW's by Adam trained on as AdamW), an optimizer over other
    parameters (a layer frozen and left out of it: torch's "doesn't match the size of
    optimizer's group", audit 70) or another model (torch's or DCP's size mismatch, naming no
    checkpoint) is refused alike on every rank, naming the checkpoint, the difference and the
    fix; its files stay as they were."""
    errors = {}
    for case in judged.others:
        ranks = outcomes(judged.out, case)
        assert ranks[0] == ranks[1] and "error" in ranks[0], f"{case}: {ranks}"
        errors[case] = ranks[0]["error"]
    fix = "or start afresh (resume=False) in another save_path/checkpoint_dir"
    optimizer = errors["other-optimizer"]
    assert optimizer.startswith("ValueError: checkpoint ") and fix in optimizer
    assert (
        "holds the state of a torch.optim.sgd.SGD optimizer, but this run passes "
        "optimizer=torch.optim.adamw.AdamW(...): pass a torch.optim.sgd.SGD"
    ) in optimizer
    groups = errors["other-groups"]  # a layer frozen, the optimizer over the others only
    assert groups.startswith("ValueError: checkpoint ") and fix in groups
    assert "optimizer whose parameter groups hold [4] parameters, but this run's" in groups
    assert "optimizer's hold [2]: build the optimizer over the same parameters" in groups
    model = errors["other-model"]
    assert model.startswith("ValueError: checkpoint ") and fix in model
    wider = f"hidden.bias is ({HIDDEN + 2},) in this model and ({HIDDEN},) in the checkpoint"
    assert f"was written for another model: {wider}, hidden.weight is ({HIDDEN + 2}, " in model
    shapes = f"out.weight is ({CLASSES}, {HIDDEN + 2}) in this model and ({CLASSES}, {HIDDEN}) in"
    assert shapes in model and "Pass model= the model it was trained with" in model
    for case, (path, before) in judged.others.items():
        assert snapshot(path) == before, f"{case}: a refused run changed the checkpoints"


# ----- pre-emption -----


@pytest.mark.parametrize(
    "config, sigterm_rank, again",
    [
        # Long tier: in CI, all ranks here, and one rank in the matrix (resumed bit for bit).
        pytest.param("plain", "1", False, id="sigterm-one-rank", marks=pytest.mark.long),
        # LRSchedulerCallback(interval="epoch"): its state must not count the pre-empted,
        # unfinished epoch as ended.
        pytest.param("epoch-lr", "all", False, id="sigterm-all-ranks-epoch-scheduler"),
        # A second SIGTERM to rank 0 while it writes a checkpoint that takes 2 s: the write
        # goes on, and rank 1 waits for it.
        pytest.param(
            "plain", "1", True, id="sigterm-again-during-a-slow-checkpoint", marks=pytest.mark.long
        ),
    ],
)
def test_sigterm_preempts_with_a_checkpoint_and_resumes_exactly(
    straight: Path, tmp_path: Path, config: str, sigterm_rank: str, again: bool
) -> None:
    """SIGTERM after update 3 (print_every=2): the flag rides log step 4's all-reduce, read
    after update 5 (the log step overlaps the next update), so the ranks stop at update 5, say
    so once, rank 0 writes a checkpoint there, rank 1 logs what rank 0 wrote (after the write:
    it learns it from rank 0), and every rank exits with 143; the same command then completes."""
    stop = 5
    sigterm = ["--sigterm-at", "3", "--sigterm-rank", sigterm_rank, "--checkpoint-every", "0"]
    first = launch(tmp_path, config, "first", *sigterm, *(["--sigterm-again"] * again), check=False)
    assert first.returncode != 0, first.describe()
    output = first.output
    assert output.count(f"SIGTERM received; stopping at step {stop}") == 1, first.describe()
    path = checkpoint_path(tmp_path, config, stop)
    # Rank 0 logs the write before it tells the others (its own pre-emption line comes after
    # that broadcast, so it may print after rank 1's).
    written = output.find(f"[rank 0] checkpoint written: {path}")
    told = output.find(f"[rank 1] pre-empted at step {stop}: rank 0 wrote the checkpoint {path}")
    assert 0 <= written < told, first.describe()
    assert f"[rank 0] pre-empted: checkpoint written at step {stop}: {path}" in output
    assert "raised SystemExit" not in output  # the pre-emption's exit is not a failure
    # torchrun's summary: one "exitcode  : N (pid: P)" per rank
    assert re.findall(r"exitcode\s+:\s*(-?\d+)", output) == ["143"] * SIZE, first.describe()
    for rank in range(SIZE):
        assert rank_result(tmp_path, config, "first", rank) == {"exit_code": 143, "step": stop}
    assert manifest_steps(tmp_path, config) == [stop], "only the pre-emption checkpoint"
    saved = torch.load(checkpoint_path(tmp_path, config, stop), weights_only=True)
    trainer_state = saved["parts"]["trainer"]
    assert trainer_state["global_step"] == stop and saved["world_size"] == SIZE
    assert not trainer_state["epoch_complete"] and "stop_requested" not in trainer_state
    if config == "epoch-lr":  # StepLR's state: epoch 1 has not ended
        step_lr = saved["parts"]["callbacks"]["all"]["LRSchedulerCallback#0"]
        assert step_lr["last_epoch"] == 0, "stepped at the pre-emption"

    assert len(trainer_state["unread_loss"]) == 2  # update 5's loss: log step 6 covers it
    resumed = launch(tmp_path, config, "resumed", "--checkpoint-every", "0")
    assert f"resumed from {checkpoint_path(tmp_path, config, stop)}" in resumed.output
    assert_matches_straight(straight, tmp_path, config, "resumed", first="first")
    logged, reference = logged_losses(tmp_path / config), logged_losses(straight / config)
    assert min(logged) == 6
    assert logged == pytest.approx({s: reference[s] for s in logged}, rel=1e-12, abs=0)


# ----- a checkpoint must never run code -----


class _Payload:
    """Unpickles as ``os.mkdir(marker)``: proof, if the directory appears, that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


@pytest.mark.usefixtures("no_dist_env")
def test_checkpoint_with_pickled_code_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """resume=<path> raises instead of running the payload; in the checkpoint directory, with a
    valid manifest entry, resume="auto" skips it with a warning and, finding no other, raises
    rather than start afresh over it (that run would overwrite step-00000005.pt)."""
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"format": 1, "model": _Payload(marker)}, evil)

    trainer = build_trainer("plain", tmp_path / "explicit")
    with pytest.raises(ValueError, match=r"evil\.pt' cannot be resumed from: UnpicklingError"):
        trainer.train(resume=str(evil))
    assert not marker.exists()

    save_path = tmp_path / "auto"
    checkpoints = save_path / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copy(evil, checkpoints / "step-00000005.pt")
    entry = {"file": "step-00000005.pt", "crc32": zlib.crc32(evil.read_bytes()), "step": 5}
    (checkpoints / "manifest.json").write_text(json.dumps([entry]))
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"none of the 1 checkpoint\(s\) of .* can be resumed"):
        build_trainer("plain", save_path).train()  # resume="auto"
    err = capsys.readouterr().err
    assert f"skipping checkpoint {checkpoints / 'step-00000005.pt'}: " in err, err
    assert (checkpoints / "step-00000005.pt").read_bytes() == evil.read_bytes(), "kept as it was"
    assert not marker.exists()

    torch.load(evil, weights_only=False)  # the payload is live: unsafe loading runs it
    assert marker.is_dir()


class _KeepsAPath(Callback):
    """A callback whose state holds a ``Path``: weights-only loading refuses it."""

    def state_dict(self) -> dict[str, Any]:
        return {"cache": Path("/tmp/cache")}


@pytest.mark.usefixtures("no_dist_env")
def test_a_state_that_would_not_load_back_is_refused_before_it_is_written(
    tmp_path: Path,
) -> None:
    """Written, every resume would skip it (and, with no other checkpoint, find none): the
    first checkpoint raises instead, naming the callback and the type, and writes nothing."""
    trainer = build_trainer("plain", tmp_path, callbacks=[_KeepsAPath()])
    with pytest.raises(
        TypeError, match=r"\['_KeepsAPath#0'\]\['cache'\]: pathlib.PosixPath is not"
    ):
        trainer.train()
    assert not list((tmp_path / "checkpoints").glob("step-*")), "nothing written"
