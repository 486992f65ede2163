"""``python -m fastdist plot``: draw the curves of ``log.jsonl`` logs (``JsonLogger``) in a PNG.

Each RUN is a JSON Lines log or a directory holding ``log.jsonl`` (the trainer's ``save_path``).
The panels show the training loss against the update step and against wall time, every
evaluation metric against the step, the throughput (samples/s) against the step and each rank's
update time (data loading + compute, ms) against the step, with all runs in the same axes,
named by their directory (or the file's stem) in the legend. A log that
holds several runs (it is appended to) is drawn from its last one. matplotlib is needed only
here: ``pip install matplotlib`` or ``pip install "fastdist[plot]"``.

Example:
    $ python -m fastdist plot save/run1 save/run2 -o curves.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

from fastdist.loggers.json_lines import DEFAULT_FILE_NAME

Record = dict[str, Any]
# Keys of an "eval" record that are not metric values.
EVAL_META_KEYS = frozenset({"kind", "step", "epoch", "time", "is_better"})
MISSING_MATPLOTLIB = (
    "fastdist plot needs matplotlib, which is not installed: "
    'pip install matplotlib (or pip install "fastdist[plot]")'
)


class PlotError(Exception):
    """A RUN that cannot be read or holds nothing to draw; the message says which and why."""


def add_parser(commands: Any) -> None:
    """Register the ``plot`` command on the ``python -m fastdist`` sub-parsers."""
    parser = commands.add_parser(
        "plot",
        help="draw loss, evaluation and throughput curves of JSONLogCallback logs to a PNG",
        description=__doc__.split("\n\nExample")[0] if __doc__ else None,
    )
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help=f"a JSON Lines log, or a directory holding {DEFAULT_FILE_NAME}",
    )
    parser.add_argument(
        "-o", "--output", default="curves.png", help="PNG file to write (default: curves.png)"
    )
    parser.add_argument("--dpi", type=int, default=100, help="resolution (default: 100)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Read every RUN and write the PNG; return 0, or 1 with a message on stderr."""
    try:
        paths = [resolve_log(run) for run in args.runs]
        runs = {name: load_run(path) for name, path in zip(run_names(paths), paths, strict=True)}
    except PlotError as exc:
        print(f"fastdist plot: {exc}", file=sys.stderr)
        return 1
    try:
        draw(runs, args.output, dpi=args.dpi)
    except ImportError as exc:
        print(f"{MISSING_MATPLOTLIB} ({exc})", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({len(runs)} run(s): {', '.join(runs)})")
    return 0


def resolve_log(run: str | os.PathLike[str]) -> Path:
    """The log file of a RUN: the path itself, or ``log.jsonl`` inside a directory."""
    path = Path(run)
    if path.is_dir():
        path = path / DEFAULT_FILE_NAME
    if not path.is_file():
        raise PlotError(f"{run}: no such log file (nor a directory holding {DEFAULT_FILE_NAME})")
    return path


def load_run(path: str | os.PathLike[str]) -> list[Record]:
    """The records of the last run in a JSON Lines log (runs begin with a ``"start"`` record).

    Lines that are not JSON objects (a line cut short by a crash) are skipped with a warning.

    Example:
        >>> [r["kind"] for r in load_run("save/log.jsonl")]
        ['start', 'train', 'train', 'eval', 'end']
    """
    runs: list[list[Record]] = [[]]
    bad = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if not isinstance(record, dict):
                bad += 1
                continue
            if record.get("kind") == "start" and runs[-1]:
                runs.append([])
            runs[-1].append(record)
    if bad:
        print(
            f"fastdist plot: {path}: skipped {bad} line(s) that are not JSON objects",
            file=sys.stderr,
        )
    if not runs[-1]:
        raise PlotError(f"{path}: no records")
    if len(runs) > 1:
        started = runs[-1][0].get("start_time", "?")
        print(
            f"fastdist plot: {path} holds {len(runs)} runs; drawing the last (started {started})",
            file=sys.stderr,
        )
    return runs[-1]


def run_names(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Legend labels: the directory name (or the file stem), with parents added until unique.

    A file named ``log.jsonl`` is named by its directory. Two paths to the same file get
    ``#2``, ``#3``... suffixes.

    Example:
        >>> run_names(["a/save/log.jsonl", "b/save/log.jsonl", "c/other.jsonl"])
        ['a/save', 'b/save', 'other']
    """
    parts: list[list[str]] = []
    for raw in paths:
        path = Path(os.path.abspath(raw))
        if path.suffix == ".jsonl" or path.is_file():
            path = (
                path.parent if path.stem == Path(DEFAULT_FILE_NAME).stem else path.with_suffix("")
            )
        parts.append([p for p in reversed(path.parts) if p != path.anchor] or [path.anchor])
    depth = [1] * len(parts)

    def name(i: int) -> str:
        return "/".join(reversed(parts[i][: depth[i]]))

    while True:
        names = [name(i) for i in range(len(parts))]
        grown = False
        for i, label in enumerate(names):
            # Grow a label that clashes with another path's (the same path twice gets #2).
            clash = any(names[j] == label and parts[j] != parts[i] for j in range(len(parts)))
            if clash and depth[i] < len(parts[i]):
                depth[i] += 1
                grown = True
        if not grown:
            break
    seen: dict[str, int] = {}
    labels = []
    for label in names:
        seen[label] = seen.get(label, 0) + 1
        labels.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return labels


def _series(records: list[Record], kind: str, x: str, y: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in records:
        if record.get("kind") != kind:
            continue
        vx, vy = record.get(x), record.get(y)
        if _is_number(vx) and _is_number(vy):
            xs.append(float(vx))
            ys.append(float(vy))
    return xs, ys


def rank_series(records: list[Record]) -> dict[int, tuple[list[float], list[float]]]:
    """Each rank's ``update_ms`` against the step, from the ``ranks`` of ``"train"`` records."""
    series: dict[int, tuple[list[float], list[float]]] = {}
    for record in records:
        if record.get("kind") != "train" or not _is_number(record.get("step")):
            continue
        for times in record.get("ranks") or ():
            if isinstance(times, dict) and _is_number(times.get("update_ms")):
                xs, ys = series.setdefault(int(times.get("rank", 0)), ([], []))
                xs.append(float(record["step"]))
                ys.append(float(times["update_ms"]))
    return series


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_keys(runs: dict[str, list[Record]]) -> list[str]:
    """Every numeric evaluation key of any run, in order of first appearance."""
    keys: dict[str, None] = {}
    for records in runs.values():
        for record in records:
            if record.get("kind") == "eval":
                for key, value in record.items():
                    if key not in EVAL_META_KEYS and _is_number(value):
                        keys.setdefault(key)
    return list(keys)


def draw(runs: dict[str, list[Record]], output: str | os.PathLike[str], dpi: int = 100) -> None:
    """Draw the panels of all ``runs`` (label -> records) into the PNG ``output``.

    Raises:
        ImportError: matplotlib is not installed.
    """
    # Imported here: matplotlib is optional, and Agg renders without a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # (title, record kind, x key, y key, x label, y label)
    panels = [
        ("training loss vs update step", "train", "step", "loss", "update step", "loss"),
        ("training loss vs wall time", "train", "time", "loss", "seconds", "loss"),
    ]
    panels += [
        (f"eval {k} vs update step", "eval", "step", k, "update step", k) for k in metric_keys(runs)
    ]
    panels.append(
        (
            "throughput vs update step",
            "train",
            "step",
            "samples_per_s",
            "update step",
            "global samples/s",
        )
    )
    ncols = 2
    nrows = math.ceil((len(panels) + 1) / ncols)  # + the per-rank update times
    fig = Figure(figsize=(6.4 * ncols, 4.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (title, kind, x, y, xlabel, ylabel) in zip(axes, panels, strict=False):
        drawn = 0
        for i, (label, records) in enumerate(runs.items()):
            xs, ys = _series(records, kind, x, y)
            if not xs:
                continue
            style = "o-" if kind == "eval" or len(xs) == 1 else "-"
            ax.plot(xs, ys, style, color=f"C{i % 10}", label=label, markersize=4)
            drawn += 1
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    _draw_rank_times(axes[len(panels)], runs)
    for ax in axes[len(panels) + 1 :]:
        ax.set_visible(False)
    directory = os.path.dirname(os.fspath(output))
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(output, format="png", dpi=dpi)


def _draw_rank_times(ax: Any, runs: dict[str, list[Record]]) -> None:
    """Per-rank update time: one line per rank of every run (a straggler stands out)."""
    lines = 0
    for i, (label, records) in enumerate(runs.items()):
        for rank, (xs, ys) in sorted(rank_series(records).items()):
            name = f"{label} rank {rank}" if len(runs) > 1 else f"rank {rank}"
            ax.plot(xs, ys, "-", color=f"C{(i + rank) % 10}", label=name)
            lines += 1
    ax.set_title("per-rank update time (data + compute) vs update step")
    ax.set_xlabel("update step")
    ax.set_ylabel("ms per update")
    ax.grid(True, alpha=0.3)
    if not lines:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    elif lines <= 16:  # beyond that the legend hides the plot
        ax.legend(fontsize="small")
