"""``python -m fastdist check-resume SCRIPT``: does a killed and resumed run end as one that ran
through?

SCRIPT builds a ``DistTrainer`` and calls ``train()``. It runs three times, from the current
directory, each under ``torchrun --standalone --nproc-per-node N`` (plain ``python`` for N = 1),
with fastdist's ``FASTDIST_CHECK_RESUME`` variable set (:mod:`fastdist.trainer.check_resume`):

1. into a fresh save directory for ``--updates`` U updates (a checkpoint every U/2);
2. into a second fresh save directory for U/2 updates, then every process is killed
   (``SIGKILL``) once that update's checkpoint is written;
3. the same command again into the second directory: it resumes there and trains to U.

The models of the checkpoints at update U of runs 1 and 3 must be equal, bit for bit. The exit
status is 0 when they are, 1 when they differ (each differing parameter is named with its
largest absolute difference), 2 when a run failed or trained fewer than U updates. The save
directories are under ``--dir`` (default: a new temporary directory); when the check passes,
they and their logs are removed (a temporary directory too, a ``--dir`` stays); the script's
own ``save_path`` and ``checkpoint_dir`` are not used.

Example:
    python -m fastdist check-resume examples/train_digits.py --updates 8 -- --epochs 1
    python -m fastdist check-resume train.py --nproc-per-node 2 --updates 20

Arguments after ``--`` are the script's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from fastdist.checkpoint.export import checkpoint_weights
from fastdist.checkpoint.lock import LOCK_FILE
from fastdist.trainer.check_resume import VAR


def add_parser(commands: Any) -> None:
    """Register the ``check-resume`` command on the ``python -m fastdist`` sub-parsers."""
    parser = commands.add_parser(
        "check-resume",
        help="check that a script's run killed halfway and resumed ends as one run through",
        description=__doc__.split("\n\nExample")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m fastdist check-resume SCRIPT [options] [-- SCRIPT_ARGS...]",
        epilog="Arguments after -- are the script's.",
    )
    parser.add_argument("script", metavar="SCRIPT", help="the training script")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--updates", type=int, default=8, help="U, even (default 8)")
    parser.add_argument("--dir", help="where the runs' save directories go (default: a temp dir)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds each run may take (default 600)"
    )
    parser.set_defaults(run=run, script_args=[])  # ``-- ARGS``: the script's (see cli.main)


class CheckError(Exception):
    """A run failed or could not be compared (exit status 2)."""


def run(args: argparse.Namespace) -> int:
    """Run the check; print its verdict; return the exit status."""
    problem = _bad_arguments(args)
    if problem:
        print(f"fastdist check-resume: {problem}", file=sys.stderr)
        return 2
    work = Path(args.dir or tempfile.mkdtemp(prefix="fastdist-check-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        differ = _check(args, work)
    except CheckError as exc:
        print(f"fastdist check-resume: {exc} (the runs are in {work})", file=sys.stderr)
        return 2
    if differ:
        print(f"check-resume FAILED: the resumed run differs at update {args.updates} in:")
        for name, diff in differ.items():
            print(f"  {name}: max abs diff {diff}")
        print(f"(the runs are in {work})")
        return 1
    print(
        f"check-resume passed: killed at update {args.updates // 2} and resumed, the model at "
        f"update {args.updates} equals an uninterrupted run's, bit for bit"
    )
    if args.dir:  # the user's directory stays: only what the check made in it goes
        for name in _MADE:
            if (work / name).is_dir():
                shutil.rmtree(work / name, ignore_errors=True)
            else:
                (work / name).unlink(missing_ok=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _bad_arguments(args: argparse.Namespace) -> str | None:
    if not os.path.isfile(args.script):
        return f"SCRIPT {args.script!r} is not a file: pass the training script's path"
    if args.updates < 2 or args.updates % 2:
        return f"--updates {args.updates}: pass an even number >= 2 (the kill is at half of it)"
    if not args.timeout > 0:
        return f"--timeout {args.timeout:g}: pass the seconds each run may take, above 0"
    if args.nproc_per_node < 1:
        return f"--nproc-per-node {args.nproc_per_node}: pass 1 or more processes"
    if args.dir and os.path.exists(args.dir) and not os.path.isdir(args.dir):
        return f"--dir {args.dir} is a file: pass a new or empty directory"
    if args.dir and os.path.exists(args.dir) and os.listdir(args.dir):
        return f"--dir {args.dir} is not empty: pass a new or empty directory"
    return None


#: What the check makes in its directory: the runs' save directories and logs.
_MADE = ("through", "resumed", "through.log", "killed.log", "resumed.log")


def _check(args: argparse.Namespace, work: Path) -> dict[str, float]:
    """The three runs; the differing parameters (by name) of the two final models."""
    half, whole = args.updates // 2, args.updates
    through, resumed = work / "through", work / "resumed"
    _run(args, work / "through.log", through, stop_at=whole, kill=False)
    straight = _final(through, whole)
    _run(args, work / "killed.log", resumed, stop_at=half, kill=True)
    _final(resumed, half)  # the kill came after the checkpoint at half
    _run(args, work / "resumed.log", resumed, stop_at=whole, kill=False)
    return _differences(straight, _final(resumed, whole))


def _run(args: argparse.Namespace, log: Path, save: Path, stop_at: int, kill: bool) -> None:
    """One run of the script; raise unless it ended as asked (killed when ``kill``)."""
    asked = {"save_path": str(save), "checkpoint_every": args.updates // 2}
    env = dict(os.environ, **{VAR: json.dumps(dict(asked, stop_at=stop_at, kill=kill))})
    command = [sys.executable, args.script, *args.script_args]
    if args.nproc_per_node > 1:
        torchrun = ["-m", "torch.distributed.run", "--standalone"]
        command[1:1] = [*torchrun, f"--nproc-per-node={args.nproc_per_node}"]
    print(f"check-resume: {' '.join(command[1:])} to update {stop_at}{' and kill' * kill}")
    with open(log, "w") as out:
        try:
            code = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired as exc:
            raise CheckError(f"a run took over {args.timeout:g} s (--timeout); see {log}") from exc
    if (code != 0) != kill:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        what = "exited 0 before its kill" if kill else f"failed (exit status {code})"
        raise CheckError(f"the run to update {stop_at} {what}; the end of {log}:\n{tail}")


def _final(save: Path, step: int) -> dict[str, torch.Tensor]:
    """The model of the newest checkpoint under ``save``, which must be at update ``step``."""
    if not (save / LOCK_FILE).exists():  # train() locks its save_path first
        raise CheckError(
            f"the script exited without calling DistTrainer.train() (nothing in {save}): "
            "check-resume runs a script that builds a DistTrainer and trains it"
        )
    try:
        weights, source = checkpoint_weights(str(save / "checkpoints"))
    except (OSError, ValueError) as exc:
        raise CheckError(f"no checkpoint in {save}: {exc}") from exc
    found = re.search(r"step-0*(\d+)", os.path.basename(source))
    reached = None if found is None else int(found.group(1))
    if reached is not None and reached < step:
        fix = f"pass --updates {reached - reached % 2}" if reached >= 2 else "give it more data"
        raise CheckError(
            f"the run trained {reached} updates, fewer than the {step} it had to (its newest "
            f"checkpoint is {source}): the script's data and n_epochs end training there, or it "
            f"stopped on its own; {fix}, or train longer (more data or epochs)"
        )
    if reached != step:
        raise CheckError(f"the newest checkpoint is {source}, not at update {step}")
    return weights


def _differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Each parameter or buffer not bit-identical in ``a`` and ``b``: its max abs diff (inf
    where one lacks it or the shapes differ)."""
    differ = {}
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x is not y:
                differ[name] = float("inf")
        elif x.shape != y.shape:
            differ[name] = float("inf")
        elif not torch.equal(x, y):
            differ[name] = float((x.double() - y.double()).abs().max())
    return differ
