"""Command-line tools, run as ``python -m fastdist COMMAND``.

Commands:

- ``env``: what a bug report needs (versions, CUDA, backends, torchrun variables) and whether
  a process group can be formed here.
- ``estimate``: the memory per rank of a model under DDP, FSDP and tensor parallelism.
- ``plot``: draw the curves of one or more runs' ``log.jsonl`` into a PNG.
- ``export``: write the model of a checkpoint (sharded or not) as one file, offline.
- ``check-resume``: run a training script through, and killed halfway then resumed; compare.
- ``hang-report``: a job's hang dumps (each rank's collective and Python line) as one report.
- ``ft``: a torchft Lighthouse and N replica groups of a script on this machine.

Example:
    >>> main(["env"])  # python -m fastdist env  # doctest: +SKIP
    >>> main(["plot", "save", "-o", "curves.png"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastdist.cli.check_resume import add_parser as add_check_resume_parser
from fastdist.cli.env import add_parser as add_env_parser
from fastdist.cli.estimate import add_parser as add_estimate_parser
from fastdist.cli.export import add_parser as add_export_parser
from fastdist.cli.ft import add_parser as add_ft_parser
from fastdist.cli.hang_report import add_parser as add_hang_report_parser
from fastdist.cli.plot import add_parser as add_plot_parser


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m fastdist`` parser, with one sub-parser per command."""
    parser = argparse.ArgumentParser(
        prog="python -m fastdist", description="fastdist command-line tools."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_env_parser(commands)
    add_estimate_parser(commands)
    add_plot_parser(commands)
    add_export_parser(commands)
    add_hang_report_parser(commands)
    add_check_resume_parser(commands)
    add_ft_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command named in ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Example:
        >>> main(["env", "--no-check"])
        0
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after it: a script's own arguments
    args = parser.parse_args(argv[:cut])
    if cut < len(argv):
        if not hasattr(args, "script_args"):
            parser.error("only check-resume takes arguments after -- (and ft): their SCRIPT's")
        args.script_args = argv[cut + 1 :]
    if args.command is None:
        parser.print_help()
        return 2
    status: int = args.run(args)
    return status


__all__ = ["build_parser", "main"]
