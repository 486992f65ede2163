"""``python -m fastdist hang-report DIR``: a job's hang dumps as one report.

DIR is the dump directory of a job whose collective failed (``<save_path>/hang`` by default,
or ``$FASTDIST_HANG_DIR``): every rank wrote its record there. The report says, per rank, the
collective it waits in or never entered (the missing ranks) and its Python line, as the failing
rank logged it; each rank's whole stack is in ``rank<r>.stack.txt`` beside it, and its flight
recorder buffer in ``rank<r>.fr.json``. A record file that does not read (truncated, corrupt)
is named in the report, with what is wrong, and the others are reported. Only the newest job's
records are reported (each record names its job): the files an earlier job left in DIR are
listed as an earlier job's, with their time, and kept.

Example:
    python -m fastdist hang-report save/hang
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from fastdist.distributed.hang_report import MAX_WORLD_SIZE, describe, read_records


def add_parser(commands: Any) -> None:
    """Register the ``hang-report`` command on the ``python -m fastdist`` sub-parsers."""
    parser = commands.add_parser(
        "hang-report",
        help="turn a job's hang dumps (<save_path>/hang) into one report",
        description=__doc__.split("\n\nExample")[0] if __doc__ else None,
    )
    parser.add_argument("dir", metavar="DIR", help="the dump directory (<save_path>/hang)")
    parser.add_argument(
        "--world-size", type=int, help="ranks in the job (default: the dumps' world size)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the report; return 0, 1 when DIR holds no dumps or one that does not read (named
    in the report), 2 for a bad ``--world-size`` (below 1 or above :data:`MAX_WORLD_SIZE`)."""
    if args.world_size is not None and not 1 <= args.world_size <= MAX_WORLD_SIZE:
        print(
            f"fastdist hang-report: --world-size {args.world_size}: pass the number of ranks "
            f"of the job (1 or more, at most {MAX_WORLD_SIZE}), or leave it out (the dumps' "
            "world size)",
            file=sys.stderr,
        )
        return 2
    records, unreadable, stale = read_records(args.dir)
    if not records and not unreadable:
        print(
            f"fastdist hang-report: no rank<r>.json in {args.dir}: pass the dump directory of a "
            "job whose collective failed (<save_path>/hang, or $FASTDIST_HANG_DIR)",
            file=sys.stderr,
        )
        return 1
    newest = max((record["time"] for record in records.values()), default=None)
    when = "?" if newest is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest))
    print(f"hang report of {args.dir} (dumped at {when}):")
    print(describe(records, args.world_size, unreadable, stale))
    return 1 if unreadable else 0
