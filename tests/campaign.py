"""The fault campaign: seeded faults of every kind, each checked, counted per kind.

Kills: one ``torchrun --max-restarts=K`` launch of tests/workers/campaign_worker.py carries K
seeded kills (attempt ``a`` carries kill ``a``), beside a straight run of every config in the
same launch. For each kill it checks that the next attempt resumed from the step the kill
left (``expect``) and that the updates it then trained were the straight run's (same samples,
same loss); for each config's last kill, that the final parameters and the predictions equal
the straight run's, bit for bit. The other kinds (disk full, a node lost, a network cut) are
in tests/campaign_faults.py.

The long campaign (>= 50 kills under DDP, FSDP and a stream, then one fault of every other
kind)::

    python tests/campaign.py --seed 1 --kills 60 --epochs 4 --table docs/campaign.md

CI runs a short seeded tier of it: tests/test_campaign.py. A failure names its seed and the
kill (its config, kind, rank, step): the same seed replays the same plan.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: this fastdist
from campaign_faults import disk_full, network_cut, node_lost  # noqa: E402
from launch import Launch, Result, free_port, run_together, torchrun_command  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workers" / "campaign_worker.py"
SIZE = 2
#: updates per epoch (2 ranks, 36 samples each in micro-batches of 4) and window sizes
WINDOWS = {"ddp": [1] * 9, "fsdp": [2, 2, 2, 2, 1], "stream": [1] * 9}
KINDS = ("update", "evaluate", "checkpoint", "rename", "predict")
VALIDATE_EVERY = 2  # campaign_worker.VALIDATE_EVERY
EVAL_FORWARDS, PREDICT_BATCHES = 2, 5  # per rank: 8 dev samples, 20 to predict, batches of 4


@dataclass
class Counts:
    """Faults of one kind: tried, survived (resumed as expected, nothing lost), data lost."""

    tried: int = 0
    survived: int = 0
    lost: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, problems: list[str], lost: bool, what: str) -> None:
        self.tried += 1
        self.survived += not problems
        self.lost += lost
        self.failures += [f"{what}: {problem}" for problem in problems]


Table = dict[str, Counts]


def draw_kills(seed: int, configs: Sequence[str], n: int, epochs: int) -> list[dict[str, Any]]:
    """``n`` kills spread over ``configs``, from ``seed``; each config's in training order
    (steps never decrease, so every kill is reached after the previous one's resume), one
    ``predict`` kill last where a config gets 5 or more."""
    rng = random.Random(seed)
    kills = []
    for index, config in enumerate(configs):
        count = n // len(configs) + (index < n % len(configs))
        windows = WINDOWS[config] * epochs
        ranks = [0] if config != "fsdp" else [0, 1]  # who writes a checkpoint file (DCP: all)
        planned = []
        for _ in range(count - (count >= 5)):
            kind = rng.choice(KINDS[:4])
            step = rng.randint(1, len(windows))
            if kind == "evaluate":  # evaluated after every VALIDATE_EVERY-th update
                step = max(VALIDATE_EVERY, step - step % VALIDATE_EVERY)
            at = {
                "update": rng.randint(1, windows[step - 1]),
                "evaluate": rng.randint(1, EVAL_FORWARDS),
            }.get(kind, 0)
            rank = rng.choice(ranks if kind in ("checkpoint", "rename") else [0, 1])
            if kind == "rename":
                rank = 0  # rank 0 publishes, files and DCP directories alike
            planned.append({"config": config, "kind": kind, "rank": rank, "step": step, "at": at})
        # Every kill resumes before its step (update, evaluation, checkpoint or rename of
        # ``step``), so the next one, at this step or later, is reached.
        kills += sorted(planned, key=lambda kill: (kill["step"], KINDS.index(kill["kind"])))
        if count >= 5:
            at = rng.randint(2, PREDICT_BATCHES)
            kill = {"config": config, "kind": "predict", "rank": rng.randint(0, 1), "step": 0}
            kills.append(dict(kill, at=at))
    return kills


def run_kills(
    out: Path, kills: list[dict[str, Any]], configs: Sequence[str], epochs: int
) -> Result:
    """One ``torchrun --max-restarts=len(kills)`` launch carrying ``kills``."""
    plan = out / "plan.json"
    plan.write_text(json.dumps({"configs": list(configs), "epochs": epochs, "kills": kills}))
    options = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    options += [f"--max-restarts={len(kills)}", "--monitor-interval=0.1"]
    cmd = torchrun_command(WORKER, SIZE, [str(out), str(plan)], options)
    timeout = 60 + 25 * (len(kills) + len(configs))
    (result,) = run_together([Launch(cmd)], timeout)
    return result


def _written(kill: dict[str, Any]) -> str:
    """What a checkpoint kill hit: a ``.pt`` file or DCP's shards."""
    if kill["kind"] not in ("checkpoint", "rename"):
        return ""
    return " (DCP)" if kill["config"] == "fsdp" else " (.pt)"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _updates(directory: Path, attempt: int, rank: int) -> list[dict[str, Any]]:
    return _lines(directory / f"a{attempt}.rank{rank}.ids.jsonl")


def check_kills(out: Path, kills: list[dict[str, Any]], result: Result, table: Table) -> None:
    """Count every kill of ``kills`` (attempt ``a`` carried ``kills[a]``) into ``table``."""
    done = _lines(out / "kills.jsonl")
    for attempt, kill in enumerate(kills):
        config = kill["config"]
        what = f"kill {attempt} ({json.dumps(kill, sort_keys=True)})"
        counts = table.setdefault(f"kill: {kill['kind']}{_written(kill)}", Counts())
        faulty, straight = out / "faulty" / config, out / "straight" / config
        problems, lost = [], False
        record = [r for r in done if r["attempt"] == attempt]
        if not record:
            counts.add([f"the kill did not happen\n{result.output[-3000:]}"], False, what)
            continue
        expect = record[0]["expect"]
        # The next attempt of this config (a later config's kill leaves this one finished).
        starts = [
            [s for s in _lines(faulty / f"starts.rank{r}.jsonl") if s["attempt"] > attempt]
            for r in range(SIZE)
        ]
        if not all(starts):
            counts.add([f"no later attempt trained {config}\n{result.output[-3000:]}"], True, what)
            continue
        got = [s[0]["start_step"] for s in starts]
        if got != [expect] * SIZE:
            problems.append(f"resumed from step {got} (by rank), not {expect}")
        resumed_attempt = starts[0][0]["attempt"]
        later = [k for k in kills[attempt + 1 :] if k["config"] == config]
        for rank in range(SIZE):
            runs = sorted(straight.glob(f"a*.rank{rank}.ids.jsonl"))  # one: never killed
            reference = {u["step"]: u for path in runs for u in _lines(path)}
            mine = _updates(faulty, resumed_attempt, rank)
            if later:  # only the updates up to where the next kill's resume began count
                nxt = [r for r in done if r["attempt"] == resumed_attempt]
                limit = nxt[0]["expect"] if nxt else 0
                mine = [u for u in mine if u["step"] <= limit]
            for update in mine:
                ref = reference.get(update["step"])
                if ref is None or (ref["ids"], ref["loss"]) != (update["ids"], update["loss"]):
                    problems.append(f"rank {rank}, update {update['step']}: other samples or loss")
                    lost = True
                    break
        if not later:
            lost |= _final_differs(faulty, straight, problems)
            temps = sorted(p.name for p in (faulty / "checkpoints").glob(".tmp-*"))
            if temps:  # each start removes those of the writes killed before it
                problems.append(f"the temps of killed writes are left: {temps}")
        counts.add(problems, lost, what)
    if result.returncode != 0:
        counts = table.setdefault("kill: update", Counts())
        counts.failures.append(f"the launch failed\n{result.describe()[-5000:]}")


def _final_differs(faulty: Path, straight: Path, problems: list[str]) -> bool:
    """Whether the killed run's final parameters or predictions differ from the straight's."""
    lost = False
    for rank in range(SIZE):
        paths = [d / f"result.rank{rank}.json" for d in (faulty, straight)]
        if not all(p.exists() for p in paths):
            problems.append(f"rank {rank} wrote no final result")
            return True
        if json.loads(paths[0].read_text())["final"] != json.loads(paths[1].read_text())["final"]:
            problems.append(f"rank {rank}: final parameters differ from the straight run's")
            lost = True
    if (faulty / "predict.jsonl").read_bytes() != (straight / "predict.jsonl").read_bytes():
        problems.append("the predictions differ from the straight run's")
        lost = True
    return lost


def markdown(table: Table, title: str) -> str:
    """The counts as a markdown table under ``title``."""
    lines = [title, "", "| fault | tried | survived | data lost |", "|---|---:|---:|---:|"]
    for kind, counts in table.items():
        lines.append(f"| {kind} | {counts.tried} | {counts.survived} | {counts.lost} |")
    total = [sum(getattr(c, a) for c in table.values()) for a in ("tried", "survived", "lost")]
    lines.append(f"| **all** | {total[0]} | {total[1]} | {total[2]} |")
    return "\n".join(lines) + "\n"


def kill_campaign(
    out: Path, seed: int, n: int, configs: Sequence[str], epochs: int, table: Table
) -> None:
    """Draw ``n`` kills from ``seed``, run them in one launch, count them into ``table``."""
    out.mkdir(parents=True, exist_ok=True)
    kills = draw_kills(seed, configs, n, epochs)
    result = run_kills(out, kills, configs, epochs)
    check_kills(out, kills, result, table)


def other_faults(seed: int, out: Path, table: Table) -> None:
    """One fault of each other kind (disk full, node lost, network cut), from ``seed``."""
    for kind, fault in (
        ("disk full", disk_full),
        ("node lost", node_lost),
        ("network cut", network_cut),
    ):
        directory = out / kind.replace(" ", "-")
        directory.mkdir(parents=True)
        try:
            problems, lost = fault(seed, directory)
        except AssertionError as exc:  # a launch failed or timed out
            problems, lost = [str(exc)], False
        table.setdefault(kind, Counts()).add(problems, lost, f"{kind} (seed {seed})")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kills", type=int, default=60, help="kills in all, over the configs")
    parser.add_argument("--configs", default="ddp,fsdp,stream")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--out", type=Path, default=None, help="work directory (default: a temp dir)"
    )
    parser.add_argument("--table", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="fastdist-campaign-"))
    table: Table = {}
    start = time.monotonic()
    kill_campaign(out / "kills", args.seed, args.kills, args.configs.split(","), args.epochs, table)
    other_faults(args.seed, out, table)
    minutes = (time.monotonic() - start) / 60
    load = os.getloadavg()[0]
    title = (
        f"Seed {args.seed}: {args.kills} kills over {args.configs} ({args.epochs} epochs), "
        f"then one fault of each other kind; {minutes:.0f} min on {os.cpu_count()} CPUs, "
        f"load {load:.1f} at the end."
    )
    text = markdown(table, title)
    print(text)
    for counts in table.values():
        for failure in counts.failures:
            print(f"FAILED: {failure}\n", file=sys.stderr)
    if args.table:
        args.table.write_text(text)
    failed = any(c.failures or c.survived < c.tried for c in table.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
