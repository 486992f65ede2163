"""Launch test worker scripts under torchrun (or as a plain process) with a hard timeout.

Every launch runs in its own session, with ``PYTHONPATH`` set so the worker can ``import
fastdist`` and import modules from ``tests/``, and with no GPU visible (``CUDA_VISIBLE_DEVICES``
empty) so that CPU tests run on CPU and gloo on any machine; a GPU test passes ``env=GPU_ENV``.
On timeout every process of the launch is killed
(torchrun starts each rank in a session of its own, so killing torchrun's group is not enough)
and an ``AssertionError`` carries all the output captured so far.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastdist.distributed.env import TORCHRUN_VARS  # a launch starts without them

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

# A launch's ``env`` entry set to None removes the variable: this one shows the GPUs the tests
# see (all of them, unless CUDA_VISIBLE_DEVICES narrows them already).
GPU_ENV: dict[str, str | None] = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}

# Marks every process of one launch (children inherit it) so a timeout can find them all.
_TOKEN_VAR = "FASTDIST_TEST_LAUNCH"


@dataclass(frozen=True)
class Result:
    """Exit status and captured output of a launch."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """Stdout followed by stderr."""
        return self.stdout + self.stderr

    def describe(self) -> str:
        """The command, exit status and both streams, for assertion messages."""
        return (
            f"command: {' '.join(self.args)}\nreturncode: {self.returncode}\n"
            f"----- stdout -----\n{self.stdout}\n----- stderr -----\n{self.stderr}"
        )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_command(
    script: str | Path, nproc: int, args: Sequence[str] = (), options: Sequence[str] = ()
) -> list[str]:
    """``python -m torch.distributed.run --nproc-per-node=N OPTIONS script ARGS``."""
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    return [*run, *options, str(script), *args]


def run_torchrun(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 120,
    env: Mapping[str, str | None] | None = None,
    cwd: str | Path | None = None,
    check: bool = True,
    max_restarts: int = 0,
) -> Result:
    """Run ``script args`` under torchrun with ``nproc`` workers on 127.0.0.1, restarted by
    torchrun up to ``max_restarts`` times.

    Every rank's stdout and stderr go to torchrun's, so ``Result`` holds all ranks' output.
    With ``check`` a non-zero exit raises ``AssertionError`` showing that output. A launch that
    fails because the rendezvous port was taken meanwhile is retried once on another port.
    """
    for _attempt in range(2):
        options = ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
        cmd = torchrun_command(script, nproc, args, [*options, f"--max-restarts={max_restarts}"])
        (result,) = run_together([Launch(cmd, env, cwd)], timeout)
        if result.returncode == 0 or "address already in use" not in result.output.lower():
            break
    return _checked(result, check)


def run_python(
    script: str | Path,
    args: Sequence[str] = (),
    timeout: float = 120,
    env: Mapping[str, str | None] | None = None,
    cwd: str | Path | None = None,
    check: bool = True,
) -> Result:
    """Run ``python script args`` as one plain process, with no torchrun variables set."""
    (result,) = run_together([Launch([sys.executable, str(script), *args], env, cwd)], timeout)
    return _checked(result, check)


def run_ranks(
    script: str | Path,
    size: int,
    args: Sequence[str],
    out: Path,
    torchrun: bool,
    cwd: str | Path | None = None,
    timeout: float = 120,
    env: Mapping[str, str | None] | None = None,
) -> tuple[Result, list[dict[str, Any]]]:
    """Run a worker that writes ``out/rank<R>.json`` per rank; return the launch and those.

    ``torchrun=False`` runs one plain process (``size`` must be 1).
    """
    if torchrun:
        result = run_torchrun(script, size, args, timeout=timeout, env=env, cwd=cwd)
    else:
        result = run_python(script, args, timeout=timeout, env=env, cwd=cwd)
    ranks = []
    for rank in range(size):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results\n{result.describe()}"
        ranks.append(json.loads(path.read_text()))
    return result, ranks


def _checked(result: Result, check: bool) -> Result:
    if check and result.returncode != 0:
        raise AssertionError(f"launch failed\n{result.describe()}")
    return result


def _launch_env(extra: Mapping[str, str | None] | None, token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    path = [str(REPO_ROOT), str(TESTS_DIR)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        **{_TOKEN_VAR: token},
    )
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@dataclass(frozen=True)
class Launch:
    """One command to start: its extra environment and working directory."""

    cmd: list[str]
    env: Mapping[str, str | None] | None = None
    cwd: str | Path | None = None


def run_together(launches: Sequence[Launch], timeout: float) -> list[Result]:
    """Start every launch at once (e.g. two torchrun "nodes"), wait for all, within ``timeout``.

    Each runs in a new session with its output in a temp file (no pipe can fill up and
    stall it). On timeout every process of every launch is killed and ``AssertionError``
    carries all the output so far.
    """
    token = uuid.uuid4().hex
    with contextlib.ExitStack() as stack:
        outs = [
            (
                stack.enter_context(tempfile.TemporaryFile("w+")),
                stack.enter_context(tempfile.TemporaryFile("w+")),
            )
            for _ in launches
        ]
        procs = [
            subprocess.Popen(
                launch.cmd,
                stdout=out,
                stderr=err,
                text=True,
                env=_launch_env(launch.env, token),
                cwd=launch.cwd if launch.cwd is not None else REPO_ROOT,
                start_new_session=True,
            )
            for launch, (out, err) in zip(launches, outs, strict=True)
        ]
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:  # KeyboardInterrupt, pytest-timeout: leave no process behind
            for proc in procs:
                _kill_launch(proc, token)
            raise
        if timed_out:
            for proc in procs:
                _kill_launch(proc, token)
        for proc in procs:
            proc.wait()
        results = []
        for launch, proc, (out, err) in zip(launches, procs, outs, strict=True):
            out.seek(0)
            err.seek(0)
            results.append(Result(launch.cmd, proc.returncode, out.read(), err.read()))
    if timed_out:
        described = "\n".join(r.describe() for r in results)
        raise AssertionError(f"launch timed out after {timeout} s\n{described}")
    return results


@dataclass
class Background:
    """A launch running in the background (see :func:`started`), its output in ``log``."""

    proc: subprocess.Popen[str]
    token: str
    log: Path

    def kill(self) -> None:
        """SIGKILL every process of the launch (as a machine that is lost)."""
        _kill_launch(self.proc, self.token)
        self.proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def started(launch: Launch, log: Path) -> Iterator[Background]:
    """Start ``launch`` in its own session, stdout and stderr to ``log``, and yield it; on
    leaving, every process of it still running is killed."""
    token = uuid.uuid4().hex
    with open(log, "w") as out:
        proc = subprocess.Popen(
            launch.cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=_launch_env(launch.env, token),
            cwd=launch.cwd if launch.cwd is not None else REPO_ROOT,
            start_new_session=True,
        )
    background = Background(proc, token, log)
    try:
        yield background
    finally:
        background.kill()


def _kill_launch(proc: subprocess.Popen[str], token: str) -> None:
    """SIGKILL the launch's process group and every process carrying its token."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    needle = f"{_TOKEN_VAR}={token}".encode()
    proc_root = Path("/proc")  # Linux only; elsewhere the ranks outlive a timeout
    for entry in proc_root.iterdir() if proc_root.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to read
            continue
