"""Every desync or failure on one rank ends the whole 2-rank job with a clear, bounded error.

Each test but the last launches tests/workers/fault_worker.py with one fault, under torchrun with a
collective timeout of 8 s, and checks the exit code, the time it took and the words of the
report (which rank, where).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from launch import Launch, Result, free_port, run_together, run_torchrun

from fastdist.cli import main as cli_main
from fastdist.distributed import bounded, position

WORKER = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
TIMEOUT = 8.0  # fault_worker.TIMEOUT
BOUND = TIMEOUT + 30  # the job must be over this long after the fault at the latest


def _launch(case: str, tmp_path: Path) -> tuple[Result, float]:
    start = time.monotonic()
    result = run_torchrun(WORKER, nproc=2, args=[case, str(tmp_path)], timeout=120, check=False)
    return result, time.monotonic() - start


def _failed(case: str, tmp_path: Path) -> str:
    return _failure(*_launch(case, tmp_path))


def _failure(result: Result, seconds: float) -> str:
    assert result.returncode != 0, result.describe()
    assert seconds < BOUND + 15, f"took {seconds:.0f} s\n{result.describe()}"  # + start-up
    return result.output


Waiting = dict[str, "Future[tuple[Result, float, Path]]"]


@pytest.fixture(scope="module")
def waiting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Waiting]:
    """The launches that mostly wait (out the collective timeout, the 20 s grace after a
    SIGTERM, a slow rank_zero_first), started together: side by side they take about the
    time of the longest. Each gives its result, its seconds and its directory."""

    def launch(case: str, path: Path) -> tuple[Result, float, Path]:
        return (*_launch(case, path), path)

    # The two cases that end well share one launch (rzf_slow, then nan_skip): it still ends
    # before peer_dies', so nan_skip costs no launch of its own.
    cases = ("timeout", "peer_dies", "rzf_slow,nan_skip")
    with ThreadPoolExecutor(len(cases)) as pool:
        # each directory made here: tmp_path_factory is not safe to call from threads
        yield {case: pool.submit(launch, case, tmp_path_factory.mktemp(case)) for case in cases}


def _ranks(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, call",
    [  # the gates are one table (fastdist.distributed.guard): CI launches fastdist.barrier,
        # which waits in the store before its collective (an audit: it waited out the timeout)
        ("master_barrier", "fastdist.barrier"),
        pytest.param("master_all_reduce", "torch.distributed.all_reduce", marks=pytest.mark.long),
    ],
)
def test_collective_in_master_callback_raises_at_once(case: str, call: str, tmp_path: Path) -> None:
    output = _failed(case, tmp_path)
    assert "[rank 0] rank 0 raised CollectiveInMasterCallbackError" in output
    assert f"callbacks_master hook AtStep.on_step_end called {call}() on rank 0 only" in output
    assert "Move this callback to callbacks_all" in output
    assert "Timed out" not in output  # raised at once, not after the timeout


@pytest.mark.slow
def test_exception_on_one_rank_stops_all_with_one_tagged_traceback(tmp_path: Path) -> None:
    output = _failed("raise_forward", tmp_path)
    assert "[rank 1] rank 1 raised ValueError: boom in forward on purpose" in output
    assert output.count('in forward\n    raise ValueError("boom in forward on purpose")') == 1
    assert "rank 1 (this rank): epoch 1, step 2, phase train" in output  # 3rd forward
    # Rank 0's hang report gives rank 1's record of its failure, which rank 1 left in the store
    # before it exited (an audit: "no record (dead, or not answering)", and not its line), and
    # is logged whole although torchrun's SIGTERM killed rank 0's DataLoader worker meanwhile
    # (an audit: the worker's death raised in rank 0 and cut the report short).
    clock = r"\d\d:\d\d:\d\d\.\d"
    failed = rf"  rank 1 \(at {clock}\): FAILED with ValueError: boom in forward on purpose\n"
    line = re.escape(_worker_line('raise ValueError("boom in forward on purpose")'))
    assert re.search(rf"{failed}.*\n    at {line} in forward \(your code\)", output), output
    assert "no record" not in output and "reported no failure" not in output


@pytest.mark.slow
def test_a_caught_error_and_sys_exit_does_not_hang_the_job(tmp_path: Path) -> None:
    """Rank 1's script catches the training error and calls sys.exit(3), with torch's default
    30-minute timeout: its exit does not wait at a barrier for rank 0, which is waiting for it
    in the gradient all-reduce (both waited until the timeout)."""
    result, seconds = _launch("raise_caught", tmp_path)
    assert result.returncode != 0
    assert "[rank 1] rank 1 raised ValueError: boom in forward on purpose" in result.output
    assert re.search(r"exitcode\s*:\s*3\b", result.output), result.describe()
    assert seconds < 40, result.describe()


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_with_one_line_and_keeps_the_checkpoints(tmp_path: Path) -> None:
    """SIGINT on every rank at update 3 (Ctrl-C in a terminal): each rank logs where it
    stopped and what is saved, no traceback; log.jsonl records it; step 2's checkpoint stays
    (it printed a KeyboardInterrupt traceback per rank, and log.jsonl said nothing)."""
    output = _failed("ctrl_c", tmp_path)
    for rank in range(2):
        assert (
            f"[rank {rank}] training interrupted (KeyboardInterrupt: Ctrl-C) at epoch 1, update 3: "
            "the checkpoints saved so far are kept; train(resume='auto') goes on from the newest"
        ) in output, output
    assert f'File "{WORKER}"' not in output and "\nKeyboardInterrupt" not in output, output
    save = tmp_path / "save"
    last = json.loads((save / "log.jsonl").read_text().splitlines()[-1])
    assert (last["kind"], last["error"], last["step"]) == ("exception", "KeyboardInterrupt: ", 3)
    kept = torch.load(save / "checkpoints" / "step-00000002.pt", weights_only=False)
    assert kept["parts"]["trainer"]["global_step"] == 2


def _worker_line(code: str) -> str:
    """``fault_worker.py:N`` of the line holding ``code``."""
    lines = WORKER.read_text().splitlines()
    return f"{WORKER}:{next(n for n, line in enumerate(lines, 1) if code in line)}"


@pytest.mark.slow
def test_timeout_reports_every_ranks_position_collective_and_line(
    waiting: Waiting, capsys: pytest.CaptureFixture[str]
) -> None:
    result, seconds, tmp_path = waiting["timeout"].result()
    output = _failure(result, seconds)
    assert "a collective failed on rank 0 (waits are bounded by 8 s" in output
    assert "Timed out" in output
    # Each line of both blocks says when it was taken: the positions (rank 1's as it last
    # published it) before the hang report (each rank's as it answered, seconds later).
    clock = r"\d\d:\d\d:\d\d\.\d"
    assert re.search(rf"rank 0 \(this rank\): epoch 1, step 2, .*\(at {clock}\)\n", output)
    # rank 1 sleeps in on_step_end of update 2, after the sync it published
    assert re.search(
        rf"rank 1: epoch 1, step 2, phase sync \(published \d+ s ago, at {clock}\)", output
    )
    assert "ranks not at this rank's position: [1]" in output
    # The hang report: rank 0 waits in DDP's all-reduce, which rank 1, asleep in the user's
    # callback, never entered; each rank's line of the worker's code.
    dumps = tmp_path / "save" / "hang"
    headline = "each rank's collective and Python line as it answered, at the time on its line "
    headline += f"(files in {dumps}: python -m fastdist "
    assert f"{headline}hang-report {dumps}):" in output, output
    report = output.split(f"hang-report {dumps}):\n", 1)[1]
    report = "\n".join(re.findall(r"^  .*", report, re.MULTILINE)[:7])  # rank 0's report only
    rank_0 = re.escape(_worker_line("result = trainer.train()") + " in main (your code)")
    rank_1 = re.escape(_worker_line("time.sleep(2 * TIMEOUT)") + " in _sleep_on_rank_1 (your code)")
    # DDP's gradient all-reduce, issued in the backward pass (on the CPU, in the main thread)
    ddp = r"\S+/fastdist/strategies/base\.py:\d+ in forward_backward"
    pattern = (
        rf"  rank 0 \(at {clock}\): FAILED with RuntimeError: .*Timed out.*\n    in "
        rf"gloo:all_reduce #(\d+) of group 1, called at {ddp}\n    at {rank_0}, innermost .*\n"
        rf"  rank 1 \(at "
        rf"{clock}\): epoch 1, step 2, phase \w+\n    never "
        rf"entered gloo:all_reduce #\1 of group 1 \(its last there: #\d+\)\n    at {rank_1}\n"
        r"  missing ranks: \[1\] never entered gloo:all_reduce #\1 of group 1 \(ranks \[0\] "
        r"entered it\)$"
    )
    assert re.fullmatch(pattern, report), report
    # python -m fastdist hang-report DIR prints the same from the files every rank wrote
    assert sorted(p.name for p in dumps.iterdir()) == [
        f"rank{r}.{kind}" for r in (0, 1) for kind in ("fr.json", "json", "stack.txt")
    ]
    jobs = {json.loads((dumps / f"rank{r}.json").read_text())["job"] for r in (0, 1)}
    assert len(jobs) == 1 and None not in jobs, jobs  # one id, shared by the job's ranks
    assert cli_main(["hang-report", str(dumps)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"hang report of {dumps} (dumped at ")
    assert printed.split("\n", 1)[1].strip("\n") == report


@pytest.mark.slow
def test_a_rank_busy_when_its_peer_dies_exits_on_sigterm(waiting: Waiting) -> None:
    """Rank 1 dies while rank 0 is busy for 60 s away from any collective. torchrun sends
    rank 0 SIGTERM; no sync point comes to agree on it, so rank 0 exits 20 s later with 143
    and says why (it ignored the signal and torchrun killed it 30 s later)."""
    result, seconds, _ = waiting["peer_dies"].result()
    assert result.returncode != 0
    assert "[rank 0] SIGTERM received 20 s ago and the ranks have not agreed" in result.output
    assert re.search(r"exitcode\s*:\s*143\b", result.output), result.describe()
    assert "SIGKILL" not in result.output, result.describe()
    assert seconds < 50, result.describe()


@pytest.mark.slow
def test_the_report_says_where_a_dead_rank_was_a_second_before(tmp_path: Path) -> None:
    """Rank 1 dies in update 4 (updates of 1.1 s, no sync point since the start): rank 0's
    report places it after update 3 (it said step 0, its last phase change), and its hang
    report, logged before torchrun's SIGTERM ends it, names rank 1 as dead."""
    result, _ = _launch("dies_mid_run", tmp_path)
    output = result.output
    assert "a collective failed on rank 0" in output, output
    assert re.search(r"rank 1: epoch 1, step 3, phase train \(published [01] s ago, at ", output)
    # torchrun's SIGTERM to rank 0 waits for the hang report, which names the dead rank; then
    # it ends rank 0 as it would have (not a SystemExit, which a script takes for pre-emption)
    assert "  rank 1: no record (dead, or not answering)" in output, result.describe()
    assert re.search(r"exitcode\s*:\s*-15\b", output), result.describe()


@pytest.mark.slow
def test_rank_zero_first_error_stops_the_waiting_ranks(tmp_path: Path) -> None:
    result, seconds = _launch("rzf_raise", tmp_path)
    assert result.returncode != 0
    assert seconds < 30, result.describe()  # seconds, not the collective timeout
    assert (
        "local rank 0 of node 0 failed inside rank_zero_first, so this rank stops" in result.output
    )
    assert "OSError: rank 0 could not build the cache" in result.output


@pytest.mark.slow
def test_rank_zero_first_outlasts_the_collective_timeout(waiting: Waiting) -> None:
    result, _, tmp_path = waiting["rzf_slow,nan_skip"].result()
    tmp_path /= "rzf_slow"
    assert result.returncode == 0, result.describe()
    assert "[rank 1] waiting for local rank 0 of node 0 to finish rank_zero_first" in result.output
    # Then a callbacks_master on_train_begin as long: the trainer's timeout does not run out.
    assert all(r["ok"] and r["steps"] == 8 for r in _ranks(tmp_path)), result.describe()


@pytest.mark.slow
def test_nonfinite_loss_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    output = _failed("nan_raise", tmp_path)
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} raised FloatingPointError: non-finite loss" in output
    # Rank 1's NaN at update 3 reaches every rank's weights, so both see NaN at update 4.
    message = "non-finite loss by update 4, first at update 3 on rank 1; ranks with a non-finite"
    assert f"{message} loss: [0, 1]" in output


@pytest.mark.slow
def test_nonfinite_weights_are_caught_before_training_ends(tmp_path: Path) -> None:
    output = _failed("inf_weight", tmp_path)
    message = "FloatingPointError: the model's parameters are NaN/Inf on ranks [0, 1] at update 8"
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} raised {message}" in output


@pytest.mark.slow
def test_nonfinite_loss_on_one_rank_is_skipped_by_every_rank(waiting: Waiting) -> None:
    result, _, tmp_path = waiting["rzf_slow,nan_skip"].result()  # after rzf_slow's training
    assert result.returncode == 0, result.describe()
    ranks = _ranks(tmp_path / "nan_skip")
    assert [r["skipped"] for r in ranks] == [1, 1]
    assert [r["steps"] for r in ranks] == [7, 7]  # 8 windows, one skipped
    assert "ranks with a non-finite loss: [1]: skipping this update" in result.output


@pytest.mark.slow
def test_master_callback_changing_the_model_is_caught(tmp_path: Path) -> None:
    output = _failed("master_edit_weight", tmp_path)
    # Edited in on_step_end of update 2, after that update's check: caught at update 3.
    assert "parameter 'linear.weight' differs across ranks at step 3" in output
    assert "[rank 1] rank 1 raised RuntimeError: parameter 'linear.weight'" in output


@pytest.mark.slow
def test_uneven_batches_are_refused_before_training(tmp_path: Path) -> None:
    output = _failed("uneven", tmp_path)
    message = "ValueError: the training sampler gives the ranks different numbers of batches"
    for rank in (0, 1):
        assert f"[rank{rank}]: {message} per epoch ([16, 8], by rank)" in output
    assert "epoch 1 step" not in output  # no training started


@pytest.mark.timeout(30)
def test_a_rank_cut_off_from_the_store_reports_within_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store's host stops answering (a network cut: here its process is stopped, so the
    connection stays open and silent): the failure report of a rank cut off from it names
    the other rank as unreachable after STORE_WAIT_S, instead of waiting forever in the
    store's ``check`` (TCPStore waits for that reply without a bound)."""
    monkeypatch.setattr(position, "STORE_WAIT_S", 0.5)
    monkeypatch.setattr(
        bounded, "_unanswered", None, raising=False
    )  # restored after: other tests ask anew
    port = free_port()
    host = subprocess.Popen(
        [sys.executable, "-c", _STORE_HOST.format(port=port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "up"
        store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
        board = position.PositionBoard(rank=1, world_size=2)
        board.store = store
        board.publish(epoch=1, step=3, phase="sync")
        _stop(host.pid)
        start = time.monotonic()
        board.publish_failure("RuntimeError: Timed out")
        report = board.report()
        seconds = time.monotonic() - start
        silent = board.silent_ranks(0.5)  # the host that did not answer is not waited for again
        again = time.monotonic() - start - seconds
    finally:
        host.kill()
        host.wait()
    assert "rank 0: unreachable (the store did not answer: TimeoutError: the rendezvous" in report
    assert "ranks not at this rank's position: [0]" in report
    assert seconds < 1.5, f"{seconds:.1f} s: {report}"  # one wait of 0.5 s, not two
    assert silent == [] and again < 0.2, (silent, again)


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every one of its threads is stopped: ``kill`` returns
    before a busy machine has stopped them, and the store's thread could still answer."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    tasks = Path(f"/proc/{pid}/task")
    while time.monotonic() < deadline:
        states = [
            (task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks.iterdir()
        ]
        if all(state in "tT" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop: thread states {states}")


_STORE_HOST = """
import time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", {port}, None, True, timedelta(seconds=60),
                      wait_for_workers=False)
print("up", flush=True)
time.sleep(120)
"""


def test_a_report_names_the_ranks_that_did_not_fail_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ranks in the same collective, rank 1 cut off: rank 0's positions cannot tell it
    (both "step 6, phase sync"); the ranks that do not publish a failure within the wait can."""
    store = dist.TCPStore("127.0.0.1", free_port(), 3, True, timedelta(seconds=10), False)
    boards = [position.PositionBoard(rank=r, world_size=3) for r in range(3)]
    for board in boards:
        board.store = store
        board.publish(epoch=1, step=6, phase="sync")
    boards[2].publish_failure("RuntimeError: Timed out")  # rank 2 failed too; rank 1 is silent
    assert "not at this rank's position" not in boards[0].report()
    start = time.monotonic()
    assert boards[0].silent_ranks(0.5) == [1]
    assert 0.5 <= time.monotonic() - start < 3


@pytest.mark.usefixtures("no_dist_env")
def test_the_master_callback_guard_refuses_only_its_own_threads_collectives() -> None:
    """While rank 0 runs a callbacks_master hook, a collective of that thread is refused, and
    one of another thread (the background checkpoint writer's, on its own group) goes through:
    the guard refused the writer's all_gather_object when a log step and a write overlapped."""
    import threading

    import torch

    from fastdist.distributed.guard import CollectiveInMasterCallbackError, no_collectives

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=10), False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        got: list[object] = []
        other = threading.Thread(target=lambda: got.append(dist.all_reduce(torch.ones(1))))
        with no_collectives("callback Printer"):
            with pytest.raises(CollectiveInMasterCallbackError, match="callback Printer called"):
                dist.all_reduce(torch.ones(1))
            other.start()
            other.join(10)
        assert got == [None], "the other thread's all_reduce did not go through"
    finally:
        dist.destroy_process_group()


def test_a_rank_that_outlives_the_store_host_exits_cleanly() -> None:
    """Plain processes, rank 0 hosting the store ends first: rank 1's hang watcher, waiting in
    the store's C++ code, is stopped at exit (it aborted the process with 'terminate called',
    exit 134, about one run in three)."""
    port = str(free_port())
    worker = str(Path(__file__).resolve().parent / "workers" / "linger_worker.py")
    launches = [Launch([sys.executable, "-u", worker, str(r), port]) for r in (0, 1)]
    results = run_together(launches, timeout=120)
    for result in results:
        assert result.returncode == 0, result.describe()
        assert "terminate called" not in result.output, result.describe()
    assert "watcher running: False" in results[1].output, results[1].describe()


def test_the_hang_report_names_a_dead_rank_that_wrote_no_dump() -> None:
    """Only rank 0 of 2 wrote its record (rank 1 was killed): the report names rank 1, from
    the world size in rank 0's record, without --world-size."""
    from fastdist.distributed.hang_report import describe

    record = {"rank": 0, "world_size": 2, "time": 0.0, "error": None, "position": "step 3"}
    record |= {"stack": [["train.py", 7, "main"]], "collectives": {}}
    assert "rank 1: no record (dead, or not answering)" in describe({0: record})


def test_the_hang_report_names_corrupt_times_and_sizes_and_stays_bounded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A time of 1e300 or NaN, a world_size of 1e9 and a file rank999999999.json are each
    named on their rank's line (they raised OverflowError / ValueError, or made a line per
    absent rank up to 1e9); --world-size above the maximum is refused naming it."""
    from fastdist.distributed.hang_report import MAX_WORLD_SIZE

    record = {"rank": 0, "world_size": 4, "time": 0.0, "error": None, "position": "step 3"}
    record |= {"stack": [["train.py", 7, "main"]], "collectives": {}}
    (tmp_path / "rank0.json").write_text(json.dumps(record))
    bad = {1: {"time": 1e300}, 2: {"time": float("nan")}, 3: {"world_size": 10**9}}
    for rank, change in bad.items():
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record | {"rank": rank} | change))
    (tmp_path / "rank999999999.json").write_text(json.dumps(record | {"rank": 999999999}))
    start = time.monotonic()
    assert cli_main(["hang-report", str(tmp_path)]) == 1
    assert time.monotonic() - start < 5
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8, lines  # headline, rank 0 (2 lines), ranks 1-3, rank 999999999, note
    assert lines[3].endswith("its time is not a time (seconds since 1970): 1e+300"), lines
    assert lines[4].endswith("its time is not a time (seconds since 1970): nan"), lines
    sizes = f"its world_size is not a number of ranks (1 to {MAX_WORLD_SIZE}): 1000000000"
    assert lines[5].endswith(sizes), lines
    huge = f"  rank 999999999: no record: {tmp_path / 'rank999999999.json'}: a rank beyond"
    assert lines[6].startswith(huge), lines
    assert cli_main(["hang-report", str(tmp_path), "--world-size", "1000000000"]) == 2
    assert f"(1 or more, at most {MAX_WORLD_SIZE})" in capsys.readouterr().err


def test_the_hang_reports_your_code_as_the_writer_saw_it() -> None:
    """Which frames are the user's is decided where the record was written (its ``yours``),
    not by the paths of the fastdist that reads it; a record without it falls back to them."""
    from fastdist.distributed.hang_report import describe

    fastdist_file = str(Path(cli_main.__code__.co_filename))  # the reader's fastdist
    stack = [["/job/train.py", 7, "main"], [fastdist_file, 40, "main"]]
    record = {"rank": 0, "world_size": 1, "time": 0.0, "error": None, "position": "step 3"}
    record |= {"stack": stack, "collectives": {}}
    written = describe({0: record | {"yours": [False, True]}})
    assert f"at {fastdist_file}:40 in main (your code)" in written, written
    assert "at /job/train.py:7 in main (your code), innermost" in describe({0: record})


def test_the_hang_report_lists_an_earlier_jobs_records_as_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An earlier job of 4 ranks (job "old") hung and dumped all its ranks; the newest job (2
    ranks, "new") failed when rank 1 died, and only rank 0 dumped. The report is the new job's:
    rank 1 has no record, and the old files are listed as an earlier job's, with their time,
    and kept."""
    record = {"rank": 0, "error": None, "position": "step 3", "collectives": {}}
    record |= {"stack": [["train.py", 7, "main"]]}
    for rank in range(4):
        old = dict(record, rank=rank, job="old", world_size=4, time=1000.0 + rank)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(old))
    new = dict(record, job="new", world_size=2, time=2000.0, error="RuntimeError: closed")
    (tmp_path / "rank0.json").write_text(json.dumps(new))
    assert cli_main(["hang-report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "FAILED with RuntimeError: closed" in lines[1], lines
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1001.0))
    earlier = f"{tmp_path}/rank1.json is an earlier job's (old, at {at})"
    assert lines[3] == f"  rank 1: no record (dead, or not answering); {earlier}", lines
    assert lines[4].startswith(f"  stale: {tmp_path}/rank2.json is an earlier job's (old, "), lines
    assert lines[5].startswith(f"  stale: {tmp_path}/rank3.json is an earlier job's (old, "), lines
    assert "step 3" not in "\n".join(lines[2:]), lines  # no old state shown as the current one
    assert len(list(tmp_path.glob("rank*.json"))) == 4  # the user's dumps are kept


@pytest.mark.usefixtures("no_dist_env")
def test_a_hang_answer_dumps_the_flight_recorder_once_and_says_where_it_could_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One answer takes one flight-recorder dump, for its record and its file alike (it took
    two); a dump directory that cannot be made is said in the answer, with why, and the
    failure report's headline says so instead of naming the files."""
    import threading

    import torch

    from fastdist.distributed import hang
    from fastdist.trainer.failure import _dumps

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "20")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=10), False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dumps: list[dict] = []

    def counted() -> dict:
        dumps.append(recorder())
        return dumps[-1]

    recorder = hang._flight_recorder
    monkeypatch.setattr(hang, "_flight_recorder", counted)
    try:
        dist.all_reduce(torch.ones(1))
        (tmp_path / "blocker").write_text("")
        for n, where in enumerate([tmp_path / "hang", tmp_path / "blocker" / "hang"], 1):
            watch = hang._Watch(store, 0, str(where), lambda: "epoch 1, step 2")
            watch.number = n  # the request it answers, in its thread, as on a rank
            thread = threading.Thread(target=watch.run, daemon=True)
            thread.start()
            store.set(f"fastdist/hang/request/{n}/0", "")
            store.wait([f"fastdist/hang/{n}/0"], timedelta(seconds=30))
            store.set(f"fastdist/hang/request/{n + 1}/0", "stop")
            thread.join(30)
            answer = json.loads(store.get(f"fastdist/hang/{n}/0"))
            assert len(dumps) == n, "the flight recorder was dumped more than once"
            assert answer["collectives"] == hang.last_collectives(dumps[-1]) != {}
            (called_at,) = [c["called_at"] for c in answer["collectives"].values()]
            assert called_at.startswith(f"{__file__}:"), called_at  # the all_reduce's line
        assert answer["dump_error"].startswith("NotADirectoryError: "), answer["dump_error"]
        monkeypatch.setattr(hang, "_watch", watch)  # this process's watcher, as watch() sets it
        headline, blocked = _dumps({0: answer}), tmp_path / "blocker" / "hang"
        assert f"(no files: they could not be written to {blocked}: NotADirectoryError" in headline
        files = tmp_path / "hang"
        fr = json.loads((files / "rank0.fr.json").read_text())
        assert fr == json.loads(json.dumps(dumps[0], default=str))
        assert json.loads((files / "rank0.json").read_text())["position"] == "epoch 1, step 2"
        # A failure's record stays in the store for the others; a new run in the process (a
        # second train() after a caught failure) writes its own failure anew and withdraws
        # the old record (an audit: the files and the CLI kept showing the first failure).
        watch.directory = str(files)
        hang.note_failure(ValueError("the first run's"))
        assert store.check(["fastdist/hang/failed/0"]) and watch.written
        watch.renew(str(files), lambda: "epoch 1, step 5")
        assert not store.check(["fastdist/hang/failed/0"]) and watch.failure is None
        hang.note_failure(KeyError("the second run's"))
        assert (
            json.loads((files / "rank0.json").read_text())["error"]
            == 'KeyError: "the second run\'s"'
        )
    finally:
        dist.destroy_process_group()


def test_the_hang_report_names_a_truncated_record_and_reports_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """rank1.json truncated, rank2.json not a record: each is named with what is wrong, rank 0
    is reported, the exit status is 1; --world-size 0 or below is refused naming it."""
    record = {"rank": 0, "world_size": 3, "time": 0.0, "error": None, "position": "step 3"}
    record |= {"stack": [["train.py", 7, "main"]], "collectives": {}}
    (tmp_path / "rank0.json").write_text(json.dumps(record))
    (tmp_path / "rank1.json").write_text(json.dumps(dict(record, rank=1))[:40])
    (tmp_path / "rank2.json").write_text(json.dumps([record]))
    assert cli_main(["hang-report", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"  rank 0 \(at \d\d:\d\d:\d\d\.\d\): step 3", lines[1]), lines
    assert lines[2:3] == ["    at train.py:7 in main (your code)"], lines
    truncated = f"  rank 1: no record: {tmp_path / 'rank1.json'}: not JSON (truncated or corrupt?)"
    assert lines[3].startswith(truncated + ": "), lines
    listed = f"  rank 2: no record: {tmp_path / 'rank2.json'}: not a record (a JSON object)"
    assert lines[4] == listed + " but a list", lines
    for size in ("0", "-2"):
        assert cli_main(["hang-report", str(tmp_path), "--world-size", size]) == 2
        error = capsys.readouterr().err
        assert f"--world-size {size}: pass the number of ranks of the job (1 or more," in error
