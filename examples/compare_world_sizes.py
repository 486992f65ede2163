"""Compare 1 process with 2 processes at the same global batch, on the digits example.

    python examples/compare_world_sizes.py                 # 1 x 64 vs 2 x 32, 10 epochs each
    python examples/compare_world_sizes.py --quick         # 1 epoch each, for a smoke test

A driver, not a launcher: it runs ``examples/train_digits.py`` twice under torchrun
(``python -m torch.distributed.run``), once on 1 process with 64 samples per process and once
on 2 processes with 32 each, so both runs make the same updates over the same global batch of
64. Each run writes its ``log.jsonl`` to ``OUT_DIR/<N>proc/save`` (the run's directory is
cleared first, so a finished run is never resumed), then ``python -m fastdist plot`` draws
both runs into one PNG and a table compares them: the last logged training loss, the best dev
accuracy, the median throughput of the logged intervals, the training time and the wall time
of the whole launch (start-up included; the first run also builds the data cache). Each
process runs one thread unless ``OMP_NUM_THREADS`` is set, so the runs use 1 and 2 cores.
With the same global batch the loss curves against the update step lie on top of each other
(up to the randomness of dropout); only the time differs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from fastdist.cli.plot import load_run

DIGITS = Path(__file__).resolve().parent / "train_digits.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(nproc: int, batch_size: int, epochs: int, out_dir: Path, cache_dir: Path) -> float:
    """Run the digits example on ``nproc`` processes under torchrun; return its wall time.

    The output of every rank goes to ``<run dir>/output.log``; a failed run prints its tail
    and exits.
    """
    run_dir = out_dir / f"{nproc}proc"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no checkpoint to resume from
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(DIGITS),
        "--epochs",
        str(epochs),
        "--batch-size-per-gpu",
        str(batch_size),
        "--save-path",
        str(run_dir / "save"),
        "--log-dir",
        str(run_dir / "logs"),
        "--cache-dir",
        str(cache_dir),
    ]
    env = dict(os.environ)
    # One thread per process (unless OMP_NUM_THREADS is set): N processes use N cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"{nproc} process(es) x batch {batch_size}: python {' '.join(cmd[1:])}", flush=True)
    start = time.monotonic()
    with open(run_dir / "output.log", "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.monotonic() - start
    if code != 0:
        tail = (run_dir / "output.log").read_text().splitlines()[-30:]
        sys.exit(f"the {nproc}-process run failed with exit code {code}:\n" + "\n".join(tail))
    return seconds


def summarize(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """The table's numbers for one run, from its ``log.jsonl`` records."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    end = next((r for r in records if r.get("kind") == "end"), {})
    start = records[0] if records else {}
    rates = [r["samples_per_s"] for r in train if r.get("samples_per_s")]
    accs = [r["acc"] for r in evals if "acc" in r]
    return {
        "world_size": start.get("world_size"),
        "global_batch": start.get("global_batch"),
        "updates": end.get("steps"),
        "final_loss": train[-1]["loss"] if train else None,
        "best_acc": max(accs) if accs else None,
        "samples_per_s": median(rates) if rates else None,
        "train_s": end.get("seconds"),
        "wall_s": wall,
        "losses": {r["step"]: r["loss"] for r in train},
    }


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    """One line per run; a missing value is shown as ``-``."""
    columns = [
        ("run", "{}"),
        ("procs", "{}"),
        ("global batch", "{}"),
        ("updates", "{}"),
        ("final loss", "{:.4f}"),
        ("best dev acc", "{:.4f}"),
        ("samples/s", "{:.0f}"),
        ("train s", "{:.1f}"),
        ("wall s", "{:.1f}"),
    ]
    keys = ["world_size", "global_batch", "updates", "final_loss", "best_acc"]
    keys += ["samples_per_s", "train_s", "wall_s"]
    lines = []
    for name, row in rows.items():
        values = [name] + [row[k] for k in keys]
        cells = [
            "-" if v is None else fmt.format(v) for (_, fmt), v in zip(columns, values, strict=True)
        ]
        lines.append(cells)
    headers = [title for title, _ in columns]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="epochs of each run")
    parser.add_argument("--quick", action="store_true", help="1 epoch each (a smoke test)")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per update")
    parser.add_argument("--out-dir", default="runs", help="where the runs go")
    parser.add_argument("-o", "--output", default="curves.png", help="the PNG of the curves")
    args = parser.parse_args()
    epochs = 1 if args.quick else args.epochs
    if args.global_batch % 2:
        parser.error("--global-batch must be even: 2 processes share it")

    out_dir = Path(args.out_dir)
    walls = {}
    for nproc in (1, 2):
        walls[nproc] = launch(nproc, args.global_batch // nproc, epochs, out_dir, out_dir / "cache")
    saves = [str(out_dir / f"{n}proc" / "save") for n in walls]
    plot = [sys.executable, "-m", "fastdist", "plot", *saves, "-o", args.output]
    subprocess.run(plot, check=True)

    rows = {
        f"{n}proc": summarize(load_run(os.path.join(save, "log.jsonl")), walls[n])
        for n, save in zip(walls, saves, strict=True)
    }
    print()
    print_table(rows)
    one, two = (row["losses"] for row in rows.values())
    common = sorted(one.keys() & two.keys())
    if common:
        gap = max(abs(one[s] - two[s]) for s in common)
        print(f"\nlargest training-loss gap at one update step: {gap:.4f} ({len(common)} steps)")


if __name__ == "__main__":
    main()
