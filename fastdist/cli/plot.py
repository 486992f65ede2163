"""``python -m fastdist plot``: draw the curves of ``log.jsonl`` logs (``JsonLogger``) in a PNG.

Each RUN is a JSON Lines log or a directory holding ``log.jsonl`` (the trainer's ``save_path``).
One panel each, over a shared update-step axis: the training loss, the learning rate, every
evaluation metric and each rank's update time (data loading + compute, ms), with all runs in the
same axes, named by their directory (or the file's stem) in the legend. A log that holds several
runs (a killed run then its resume) is drawn as one curve: a later run's records replace the
earlier ones from the step it started at, and a dotted line marks where it resumed. matplotlib
is needed only here: ``pip install matplotlib`` or ``pip install "fastdist[plot]"``.

Example:
    $ python -m fastdist plot save/run1 save/run2 -o curves.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

from fastdist.checkpoint.export import refuse_in_checkpoints
from fastdist.loggers.json_lines import DEFAULT_FILE_NAME

#: The first bytes of every PNG file.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

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
        help="draw loss, learning rate, evaluation and rank-time curves of logs to a PNG",
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
    parser.add_argument("--dpi", type=_dpi, default=150, help="resolution, 1-1200 (default: 150)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Read every RUN and write the PNG; return 0, or 1 with a message on stderr."""
    try:
        paths = [resolve_log(run) for run in args.runs]
        check_output(args.output, paths)
        runs = {name: load_run(path) for name, path in zip(run_names(paths), paths, strict=True)}
    except PlotError as exc:
        print(f"fastdist plot: {exc}", file=sys.stderr)
        return 1
    try:
        draw(runs, args.output, dpi=args.dpi)
    except ImportError as exc:
        print(f"{MISSING_MATPLOTLIB} ({exc})", file=sys.stderr)
        return 1
    except OSError as exc:  # a directory, no such folder, no permission
        why = exc.strerror or type(exc).__name__
        print(f"fastdist plot: cannot write {args.output}: {why}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({len(runs)} run(s): {', '.join(runs)})")
    return 0


def check_output(output: str, logs: Sequence[Path]) -> None:
    """Refuse an ``output`` that would replace something saved: a log it reads, a file in a
    checkpoint directory, or any existing file that is not a PNG."""
    if any(os.path.realpath(output) == os.path.realpath(log) for log in logs):
        raise PlotError(f"-o {output} is a log it reads: pass a .png path")
    try:
        refuse_in_checkpoints("-o", output)
    except ValueError as exc:
        raise PlotError(str(exc)) from exc
    if os.path.isfile(output):
        with open(output, "rb") as f:
            if f.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
                raise PlotError(f"-o {output} exists and is not a PNG: pass another path")


def _dpi(value: str) -> int:
    """``--dpi``: an integer from 1 to 1200 (more would not fit in memory)."""
    dpi = int(value)
    if not 1 <= dpi <= 1200:
        raise argparse.ArgumentTypeError(f"must be from 1 to 1200, got {dpi}")
    return dpi


def resolve_log(run: str | os.PathLike[str]) -> Path:
    """The log file of a RUN: the path itself, or ``log.jsonl`` inside a directory."""
    path = Path(run)
    if path.is_dir():
        path = path / DEFAULT_FILE_NAME
    if not path.is_file():
        raise PlotError(f"{run}: no such log file (nor a directory holding {DEFAULT_FILE_NAME})")
    return path


def load_run(path: str | os.PathLike[str]) -> list[Record]:
    """The records of a JSON Lines log, its runs joined into one (each begins with ``"start"``).

    A resumed run's ``"start"`` record has the step it resumed from: the records of the earlier
    runs past that step (logged by the killed run after its last checkpoint) are replaced by the
    resumed run's, so no step is drawn twice. A fresh run in the same file starts at step 0 and
    so replaces everything but the earlier ``"start"`` records. Lines that are not JSON objects
    (a line cut short by a crash) are skipped with a warning.

    Example:
        >>> [(r["kind"], r["step"]) for r in load_run("save/log.jsonl")]  # killed, resumed at 20
        [('start', 0), ('train', 10), ('train', 20), ('start', 20), ('train', 30), ('end', 30)]
    """
    records: list[Record] = []
    parts = bad = 0
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as exc:
        raise PlotError(f"{path} is not a text log ({exc.reason}): pass a log.jsonl") from exc
    for line in lines:
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
        if record.get("kind") == "start":
            parts += 1
            resumed_at = record.get("step")
            if not _is_number(resumed_at):
                resumed_at = 0
            records = [r for r in records if _step_at_most(r, resumed_at)]
        records.append(record)
    if bad:
        print(
            f"fastdist plot: {path}: skipped {bad} line(s) that are not JSON objects",
            file=sys.stderr,
        )
    if not records:
        raise PlotError(f"{path}: no records")
    if parts > 1:
        print(
            f"fastdist plot: {path} holds {parts} runs; joined them, a later run replacing the"
            " steps it logged again",
            file=sys.stderr,
        )
    return records


def _step_at_most(record: Record, step: float) -> bool:
    """Whether ``record`` stays when a run starts at ``step``: a start record, or not past it."""
    value = record.get("step")
    return record.get("kind") == "start" or not _is_number(value) or value <= step


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


def draw(runs: dict[str, list[Record]], output: str | os.PathLike[str], dpi: int = 150) -> None:
    """Draw the panels of all ``runs`` (label -> records) into the PNG ``output``.

    Raises:
        ImportError: matplotlib is not installed.
    """
    fig = figure(runs)
    directory = os.path.dirname(os.fspath(output))
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(output, format="png", dpi=dpi)


def figure(runs: dict[str, list[Record]]) -> Any:
    """The matplotlib ``Figure`` of all ``runs``: one panel per curve over a shared step axis.

    Raises:
        ImportError: matplotlib is not installed.
    """
    # Imported here: matplotlib is optional, and Agg renders without a display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # (record kind, key, y label)
    panels = [("train", "loss", "training loss"), ("train", "lr", "learning rate")]
    panels += [("eval", key, f"dev {key}") for key in metric_keys(runs)]
    fig = Figure(figsize=(7.0, 1.7 * (len(panels) + 1) + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels) + 1, 1, sharex=True, squeeze=False)[:, 0]
    for ax, (kind, key, ylabel) in zip(axes, panels, strict=False):
        for i, (label, records) in enumerate(runs.items()):
            xs, ys = _series(records, kind, "step", key)
            if not xs:
                continue
            style = "o-" if kind == "eval" or len(xs) == 1 else "-"
            ax.plot(xs, ys, style, color=f"C{i % 10}", label=label, markersize=3, linewidth=1.4)
        ax.set_ylabel(ylabel)
    _draw_rank_times(axes[-1], runs)
    axes[-1].set_xlabel("optimizer update step")
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in axes:
        _finish_panel(ax, runs)
    fig.align_ylabels(axes)
    if len(runs) > 1:
        axes[0].legend(fontsize="small", frameon=False)
    return fig


def _finish_panel(ax: Any, runs: dict[str, list[Record]]) -> None:
    """Grid, tidy spines, "no data" on an empty panel and a dotted line where a run resumed."""
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.spines[["top", "right"]].set_visible(False)
    if not ax.lines:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for records in runs.values():
        for record in records:
            step = record.get("step")
            if record.get("kind") == "start" and _is_number(step) and step > 0:
                ax.axvline(step, color="0.5", linestyle=":", linewidth=1)


def _draw_rank_times(ax: Any, runs: dict[str, list[Record]]) -> None:
    """Per-rank update time: one line per rank of every run (a straggler stands out)."""
    for i, (label, records) in enumerate(runs.items()):
        for rank, (xs, ys) in sorted(rank_series(records).items()):
            name = f"{label} rank {rank}" if len(runs) > 1 else f"rank {rank}"
            style = "o-" if len(xs) == 1 else "-"  # one log step: a line of one point is not drawn
            ax.plot(
                xs, ys, style, color=f"C{(i + rank) % 10}", label=name, markersize=3, linewidth=1.2
            )
    ax.set_ylabel("update time (ms)")
    if 1 < len(ax.lines) <= 16:  # beyond that the legend hides the plot
        ax.legend(fontsize="small", frameon=False, ncols=min(len(ax.lines), 4))
