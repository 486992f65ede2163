"""fastdist's own work per micro-batch and per update, counted in CPU instructions: exact and
repeatable where timings on a shared VM move by more than the effect.

Run on demand from the repository root (needs valgrind; about 5 minutes)::

    python benchmarks/instructions.py [--updates 40]

It runs itself again under valgrind's callgrind, in one process (torch is imported once),
and trains the loops of ``micro_batch.py`` (a ``Linear(8, 2)`` on pre-made batches: the hand
loop, and ``DistTrainer`` with its defaults) with updates of 1 and of 16 micro-batches. Each
loop trains 3 updates to warm up, then 5, then ``5 + --updates``; a call of ``os.getppid()``
between them makes callgrind write its counts so far (``--dump-before``), so the difference
of the last two runs is the instructions of ``--updates`` updates, set-up excluded. fastdist's
own count is its difference to the hand loop, split as in ``micro_batch.py`` into a part per
micro-batch ((16 - 1) / 15) and one per update. Python's garbage collector is off while the
loops run: its collections' cost grows with the whole process's heap, and moved the hand
loop's count by 100k instructions per update between two builds of fastdist (the objects
only a collection frees live on until the process ends: a few MB). Python's hash seed is
fixed, so a run repeats to a few instructions per update; an instruction count is not a time
(a cache miss costs more than an add), but it moves only when the work does.
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WINDOWS = (1, 16)  # micro-batches per update
LOOPS = ("hand", "fastdist")
RUNS = (3, 5)  # updates of the warm-up and of the first counted run


def inner(updates: int) -> None:
    """The runs, marked for callgrind: each run ends with a call of ``os.getppid()``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging

    import torch

    from benchmarks import micro_batch

    torch.set_num_threads(1)
    logging.getLogger("fastdist").setLevel(logging.WARNING)
    data = micro_batch.batches((RUNS[1] + updates) * max(WINDOWS))
    loops = {"hand": micro_batch.hand, "fastdist": micro_batch.fastdist_loop}
    gc.collect()
    gc.disable()  # no collection counted (see above)
    os.getppid()  # the end of the imports
    for name in LOOPS:
        for k in WINDOWS:
            for n in (*RUNS, RUNS[1] + updates):
                loops[name](data[: n * k], k)
                os.getppid()


def counts(directory: str) -> list[int]:
    """The instructions of every part callgrind wrote, in order (the last: the exit)."""
    parts: dict[int, int] = {}
    for path in glob.glob(os.path.join(directory, "cg.out*")):
        part = total = None
        with open(path) as f:
            for line in f:
                if line.startswith("part:"):
                    part = int(line.split()[1])
                elif line.startswith("totals:"):
                    total = int(line.split()[1])
        if part is not None and total is not None:
            parts[part] = total
    return [parts[p] for p in sorted(parts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args.updates)
        return
    with tempfile.TemporaryDirectory() as directory:
        command = [
            "valgrind", "--tool=callgrind", "--dump-before=os_getppid*",
            f"--callgrind-out-file={directory}/cg.out", sys.executable, os.path.abspath(__file__),
            "--inner", "--updates", str(args.updates),
        ]  # fmt: skip
        env = dict(os.environ, PYTHONHASHSEED="0")
        subprocess.run(command, check=True, env=env, stderr=subprocess.DEVNULL)
        parts = counts(directory)
    expected = 1 + len(LOOPS) * len(WINDOWS) * (len(RUNS) + 1) + 1  # imports, runs, exit
    if len(parts) != expected:  # another caller of os.getppid() would shift the runs
        raise SystemExit(f"callgrind wrote {len(parts)} parts, not {expected}: no figures")
    runs = iter(parts[1:])  # parts[0]: start-up and imports
    per_update: dict[tuple[str, int], float] = {}
    for name in LOOPS:
        for k in WINDOWS:
            _warm_up, first, longer = next(runs), next(runs), next(runs)
            per_update[name, k] = (longer - first) / args.updates
    print(f"instructions per update ({args.updates} updates counted, one process, CPU):")
    print("micro-batches  hand         fastdist     fastdist - hand")
    extra = {}
    for k in WINDOWS:
        hand, fast = per_update["hand", k], per_update["fastdist", k]
        extra[k] = fast - hand
        print(f"{k:13d}  {hand:11,.0f}  {fast:11,.0f}  {extra[k]:11,.0f}")
    long, short = max(WINDOWS), min(WINDOWS)
    each = (extra[long] - extra[short]) / (long - short)
    print(f"fastdist's own: {each:,.0f} per micro-batch, {extra[short] - each:,.0f} per update")


if __name__ == "__main__":
    main()
