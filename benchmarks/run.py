"""fastdist vs a hand-written DDP loop: throughput, communication, import time and memory.

Run on demand (never in CI), from the repository root with the project's venv active::

    python benchmarks/run.py [--workload {tiny,medium,accumulation,all}] [--nproc N]
                             [--repeats R] [--rounds K] [--steps S]

Every case is launched with torchrun on 127.0.0.1 (gloo on CPU, and nccl as well when CUDA is
available), ``OMP_NUM_THREADS=1`` per process. Every repeat is one launch whose processes run
``--rounds`` rounds of the loops one after another (fastdist with the defaults, hand,
fastdist with no periodic loss logging; each round starts with the next one), so the loops
share cores, placement and connections and slow drifts of the machine hit them alike. Then
each loop runs alone in its own launch, for its peak memory. Medians over the runs are
reported, with the fastdist/hand ratio of samples/s within each round; see
``docs/benchmarks.rst`` for what is timed and the measured results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import busy_jiffies, child_env, torchrun_command

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
WORKER = BENCH_DIR / "worker.py"
RESULT_PREFIX = "BENCH_JSON "
WORKLOAD_NAMES = ("tiny", "medium", "accumulation")
# Issue targets (2 processes, gloo): fastdist/hand samples/s, import time, memory.
THROUGHPUT_TARGETS = {"tiny": 0.97, "medium": 0.99}
IMPORT_TARGET_S = 0.1
RSS_TARGET = 1.05


@dataclass(frozen=True)
class Variant:
    """One row of the results: a loop and, for fastdist, its ``print_every``."""

    label: str
    loop: str
    print_every: int  # 0: more than the run's updates (no periodic loss logging)


VARIANTS = (
    Variant("fastdist", "fastdist", 10),  # the headline: the defaults (print_every=10)
    Variant("hand", "hand", 0),
    Variant("fastdist no logging", "fastdist", 0),
)


def wait_idle(max_wait: float, threshold: float = 0.2, sample: float = 0.5) -> float:
    """Wait (at most ``max_wait`` s) until other processes use < ``threshold`` cores.

    Returns the load of the last sample, in cores. On a shared machine this keeps launches
    out of other jobs' bursts; on an idle one it costs one ``sample``.
    """
    deadline = time.perf_counter() + max_wait
    hz = os.sysconf("SC_CLK_TCK")
    while True:
        busy0 = busy_jiffies()
        time.sleep(sample)
        load = (busy_jiffies() - busy0) / hz / sample
        if load < threshold or time.perf_counter() >= deadline:
            return load


def children_cpu() -> float:
    """CPU seconds of this script's finished children (torchrun and its workers)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(
    workload: str,
    variants: list[Variant],
    nproc: int,
    backend: str,
    steps: int | None,
    timeout: float,
) -> list[dict[str, Any]]:
    """Run ``variants`` one after another in one torchrun job; rank 0's result of each."""
    runs = ",".join(f"{v.loop}:{v.print_every}" for v in variants)
    args = [f"--runs={runs}", f"--workload={workload}", f"--backend={backend}"]
    cmd = torchrun_command(str(WORKER), nproc, args)
    if steps is not None:
        cmd.append(f"--steps={steps}")
    busy0, cpu0, start = busy_jiffies(), children_cpu(), time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        msg = f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{err[-4000:]}"
        raise RuntimeError(msg) from None
    wall = time.perf_counter() - start
    lines = [
        line[len(RESULT_PREFIX) :] for line in out.splitlines() if line.startswith(RESULT_PREFIX)
    ]
    if len(lines) != len(variants):
        raise RuntimeError(
            f"exit status {proc.returncode}: {' '.join(cmd)}\n{out[-2000:]}\n{err[-4000:]}"
        )
    # Other processes' CPU use while this launch ran, in cores (machine busy minus ours).
    foreign = (busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK") - (children_cpu() - cpu0)
    results = []
    for variant, line in zip(variants, lines, strict=True):
        result: dict[str, Any] = json.loads(line)
        # Results printed before the job failed (e.g. while tearing down) are still
        # measurements; the failure is kept and reported.
        result["exit_status"] = proc.returncode
        if proc.returncode != 0:
            tail = [ln for ln in err.splitlines() if "terminate" in ln or "Error" in ln]
            result["exit_note"] = "; ".join(tail[-3:])
        result.update(
            variant=variant.label,
            solo=len(variants) == 1,
            launch_wall_s=wall,
            foreign_cores=max(foreign, 0) / wall,
        )
        results.append(result)
    return results


def time_imports(repeats: int) -> dict[str, Any]:
    """Wall time of fresh ``import torch`` and ``import torch, fastdist`` processes, alternated.

    Bytecode is cached (the dropped first round writes it) as an installed package has it,
    even where ``PYTHONDONTWRITEBYTECODE`` is set: compiling every module at each import
    would add about 0.13 s here that no user pays twice."""
    env = child_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cases = {"torch": "import torch", "torch+fastdist": "import torch, fastdist"}
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats + 1):  # the first round warms the page cache and is dropped
        for name, code in cases.items():
            start, cpu0 = time.perf_counter(), children_cpu()
            subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, check=True)
            if i:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(children_cpu() - cpu0)
    # The same difference measured inside one process, which is less noisy.
    code = (
        "import time, torch; t = time.perf_counter(); import fastdist; "
        "print(time.perf_counter() - t)"
    )
    inproc = [
        float(
            subprocess.run(
                [sys.executable, "-c", code],
                cwd=REPO_ROOT,
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        for _ in range(repeats)
    ]
    torch_s = statistics.median(times["torch"])
    both_s = statistics.median(times["torch+fastdist"])
    return {
        "torch_s": torch_s,
        "torch_fastdist_s": both_s,
        "delta_s": both_s - torch_s,
        "cpu_delta_s": statistics.median(cpu["torch+fastdist"]) - statistics.median(cpu["torch"]),
        "in_process_s": statistics.median(inproc),
        "repeats": repeats,
    }


def run_overhead(rounds: int, timeout: float) -> dict[str, Any] | None:
    """Run ``overhead.py`` (its own 2-process job); its JSON result, with its report as text."""
    cmd = [sys.executable, str(BENCH_DIR / "overhead.py"), "--json", f"--rounds={rounds}"]
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    lines = proc.stdout.splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        print(f"overhead.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return None
    result: dict[str, Any] = json.loads(lines[-1])
    result["report"] = "\n".join(lines[:-1])
    return result


def machine_info(nproc: int) -> dict[str, Any]:
    """CPU, torch version, date and git revision, for the report."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        rev = "unknown"
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "nproc": nproc,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
        "git": rev,
    }


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main_thread_us(run: dict[str, Any]) -> float:
    """Main-thread CPU microseconds per optimizer update, averaged over the ranks."""
    per_rank = run["main_thread_cpu_s_ranks"]
    return sum(per_rank) / len(per_rank) / run["timed_updates"] * 1e6


def quiet(runs: list[dict[str, Any]], max_foreign: float) -> list[dict[str, Any]]:
    """The runs during which other processes stayed under ``max_foreign`` cores, if >= 3."""
    kept = [r for r in runs if r["foreign_cores"] <= max_foreign]
    return kept if len(kept) >= 3 else runs


def summarize(results: list[dict[str, Any]], max_foreign: float) -> list[dict[str, Any]]:
    """One row per (backend, workload, variant): medians, spread and ratios to the hand loop.

    Throughput, CPU and communication come from the shared launches (runs disturbed by other
    processes, over ``max_foreign`` cores, are left out when at least 3 remain); the paired
    ratio is the median over rounds of fastdist/hand within one round (consecutive runs in
    the same processes). Peak RSS comes from the launches where the loop ran alone.
    """
    rows = []
    groups: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        groups.setdefault((r["backend"], r["workload"]), {}).setdefault(r["variant"], []).append(r)
    for (backend, workload), by_variant in groups.items():
        hand = quiet([r for r in by_variant.get("hand", []) if not r["solo"]], max_foreign)
        hand_by_round = {tuple(h["round"]): h for h in hand}
        hand_alone = [r for r in by_variant.get("hand", []) if r["solo"]]
        for variant in VARIANTS:
            shared = [r for r in by_variant.get(variant.label, []) if not r["solo"]]
            runs = quiet(shared, max_foreign)
            alone = [r for r in by_variant.get(variant.label, []) if r["solo"]]
            if not runs:
                continue
            sps = [r["samples_per_s"] for r in runs]
            row: dict[str, Any] = {
                "backend": backend,
                "workload": workload,
                "variant": variant.label,
                "runs": len(runs),
                "all_runs": len(shared),
                "samples_per_s": statistics.median(sps),
                "min": min(sps),
                "max": max(sps),
                "main_us": statistics.median(main_thread_us(r) for r in runs),
                "rss_mib": median_of(alone, "rss_mib_max") if alone else None,
                "comm": runs[0]["comm_per_update"],
                "checksums": sorted({r["checksum"] for r in runs}),
                "timed_updates": runs[0]["timed_updates"],
                "bad_exits": sum(1 for r in runs if r["exit_status"] != 0),
            }
            if hand:
                row["ratio"] = row["samples_per_s"] / median_of(hand, "samples_per_s")
                pairs = [
                    r["samples_per_s"] / hand_by_round[tuple(r["round"])]["samples_per_s"]
                    for r in runs
                    if tuple(r["round"]) in hand_by_round
                ]
                row["paired_ratio"] = statistics.median(pairs) if pairs else 0.0
                row["pairs"] = len(pairs)
                row["main_us_delta"] = row["main_us"] - statistics.median(
                    main_thread_us(h) for h in hand
                )
                if alone and hand_alone:
                    row["rss_ratio"] = row["rss_mib"] / median_of(hand_alone, "rss_mib_max")
                row["same_weights"] = row["checksums"] == sorted({h["checksum"] for h in hand})
            rows.append(row)
    return rows


def print_results(rows: list[dict[str, Any]]) -> None:
    """The results table, then the all-reduce counts of the workloads that count them."""
    header = (
        f"{'workload':<13}{'backend':<8}{'loop':<25}{'runs':>5}{'samples/s':>10}{'min..max':>15}"
        f"{'vs hand':>9}{'paired':>8}{'CPU us/upd':>11}{'+us':>7}{'RSS MiB':>9}{'vs hand':>9}"
        f"  same weights"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = f"{row['min']:.0f}..{row['max']:.0f}"
        print(
            f"{row['workload']:<13}{row['backend']:<8}{row['variant']:<25}"
            f"{row['runs']:>5}{row['samples_per_s']:>10.0f}{spread:>15}{row.get('ratio', 0):>9.3f}"
            f"{row.get('paired_ratio', 0):>8.3f}{row['main_us']:>11.0f}"
            f"{row.get('main_us_delta', 0):>+7.0f}{row['rss_mib'] or 0:>9.1f}"
            f"{row.get('rss_ratio', 0):>9.3f}  {'yes' if row.get('same_weights') else 'NO'}"
        )
    comm_rows = [row for row in rows if row["comm"]]
    if comm_rows:
        print()
        print("all-reduce per optimizer update (counted in the timed steady state):")
        print(
            f"  {'workload':<13}{'backend':<8}{'loop':<25}{'DDP calls':>10}{'DDP bytes':>12}"
            f"{'other calls':>13}{'other bytes':>13}"
        )
        for row in comm_rows:
            c = row["comm"]
            print(
                f"  {row['workload']:<13}{row['backend']:<8}{row['variant']:<25}"
                f"{c['ddp_calls']:>10.3f}{c['ddp_bytes']:>12.1f}"
                f"{c['explicit_calls']:>13.4f}{c['explicit_bytes']:>13.3f}"
            )


def targets(
    rows: list[dict[str, Any]], imports: dict[str, Any] | None, nproc: int
) -> list[tuple[str, str, str, bool]]:
    """``(target, measured, goal, passed)`` for every issue target that this run measured."""
    out: list[tuple[str, str, str, bool]] = []
    gloo = {(r["workload"], r["variant"]): r for r in rows if r["backend"] == "gloo"}
    for workload, goal in THROUGHPUT_TARGETS.items():
        row = gloo.get((workload, "fastdist"))
        if row and "ratio" in row:
            measured = f"paired {row['paired_ratio']:.3f} (of medians {row['ratio']:.3f})"
            passed = row["paired_ratio"] >= goal
            out.append((f"{workload}: samples/s fastdist/hand", measured, f">= {goal}", passed))
    # The headline row's log steps add an all-reduce every 10 updates by design.
    fd = gloo.get(("accumulation", "fastdist no logging"))
    hand = gloo.get(("accumulation", "hand"))
    if fd and hand and fd["comm"] and hand["comm"]:
        f, h = fd["comm"], hand["comm"]
        for what, fmt in (("calls", ".4f"), ("bytes", ".1f")):
            ddp_f, ddp_h = f[f"ddp_{what}"], h[f"ddp_{what}"]
            measured = f"{ddp_f:{fmt}} vs {ddp_h:{fmt}}"
            out.append(
                (
                    f"accumulation: gradient all-reduce {what}/update",
                    measured,
                    "equal",
                    ddp_f == ddp_h,
                )
            )
            all_f = ddp_f + f[f"explicit_{what}"]
            all_h = ddp_h + h[f"explicit_{what}"]
            measured = f"{all_f:{fmt}} vs {all_h:{fmt}}"
            out.append(
                (f"accumulation: all all-reduce {what}/update", measured, "equal", all_f == all_h)
            )
    if imports:
        out.append(
            (
                "import fastdist over import torch",
                f"{imports['delta_s']:+.3f} s (in-process {imports['in_process_s']:.3f} s)",
                f"<= {IMPORT_TARGET_S} s",
                imports["delta_s"] <= IMPORT_TARGET_S,
            )
        )
    rss = [r for r in gloo.values() if r["variant"] == "fastdist" and "rss_ratio" in r]
    if rss:
        worst = max(rss, key=lambda r: r["rss_ratio"])
        out.append(
            (
                "peak RSS fastdist/hand (worst workload)",
                f"{worst['rss_ratio']:.3f} ({worst['workload']})",
                f"<= {RSS_TARGET}",
                worst["rss_ratio"] <= RSS_TARGET,
            )
        )
    if nproc != 2:
        out = [(f"{t} [nproc={nproc}]", m, g, p) for t, m, g, p in out]
    return out


def measure(
    workload: str,
    backend: str,
    variants: list[Variant],
    args: argparse.Namespace,
    failures: list[str],
) -> list[dict[str, Any]]:
    """Launch ``variants`` in one job, again (``args.retries`` times) if others were busy."""
    runs: list[dict[str, Any]] = []
    for attempt in range(1 + args.retries):
        if args.idle_wait > 0:
            wait_idle(args.idle_wait)
        try:
            runs = launch(workload, variants, args.nproc, backend, args.steps, args.timeout)
        except RuntimeError as exc:
            failures.append(str(exc))
            print(f"FAILED {workload} {backend} {[v.label for v in variants]}:\n{exc}")
            return []
        for r in runs:
            r["attempt"] = attempt + 1
        if runs[0]["foreign_cores"] <= args.max_foreign:
            break
        print(f"  (others used {runs[0]['foreign_cores']:.2f} cores: measured again)", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--workload", choices=(*WORKLOAD_NAMES, "all"), default="all")
    parser.add_argument("--nproc", type=int, default=2, help="processes per case (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="launches per workload (default 5)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of every loop per launch (default 3)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed optimizer updates per run (default: "
        "per workload, tiny 1000, medium 60, accumulation 250)",
    )
    parser.add_argument("--import-repeats", type=int, default=10, help="0 skips the import timing")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument(
        "--idle-wait",
        type=float,
        default=10,
        help="before each launch wait up to this many seconds for other processes to go "
        "below 0.2 cores (0: do not wait)",
    )
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.2,
        help="a run during which other processes used more cores than this is run again",
    )
    parser.add_argument(
        "--retries", type=int, default=2, help="how often such a run is run again (default 2)"
    )
    parser.add_argument(
        "--overhead-rounds",
        type=int,
        default=3,
        help="rounds of benchmarks/overhead.py (fastdist's own time per update); 0 skips it",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write all raw results here")
    args = parser.parse_args()
    if min(args.nproc, args.repeats, args.rounds, args.steps or 1) < 1:
        parser.error("--nproc, --repeats, --rounds and --steps must be >= 1")

    info = machine_info(args.nproc)
    print(
        f"# {info['date']}  {info['cpu']} ({info['cores']} cores)  torch {info['torch']}  "
        f"python {info['python']}  git {info['git']}  nproc {args.nproc}  "
        f"repeats {args.repeats} x rounds {args.rounds}",
        flush=True,
    )
    backends = ["gloo"] + (["nccl"] if info["cuda"] else [])
    workloads = WORKLOAD_NAMES if args.workload == "all" else (args.workload,)
    started = time.perf_counter()
    imports = time_imports(args.import_repeats) if args.import_repeats > 0 else None
    if imports:
        print(
            f"import torch {imports['torch_s']:.3f} s, import torch+fastdist "
            f"{imports['torch_fastdist_s']:.3f} s (fresh processes, median of "
            f"{imports['repeats']}): {imports['delta_s']:+.3f} s wall, "
            f"{imports['cpu_delta_s']:+.3f} s CPU; in-process {imports['in_process_s']:.3f} s",
            flush=True,
        )
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    n = len(VARIANTS)
    for backend in backends:
        for workload in workloads:
            jobs = []
            for rep in range(args.repeats):  # every round starts with the next loop
                rounds = range(rep * args.rounds, (rep + 1) * args.rounds)
                order = [VARIANTS[(k + i) % n] for k in rounds for i in range(n)]
                jobs.append((f"rep {rep + 1}/{args.repeats}", order))
            jobs += [("alone", [variant]) for variant in VARIANTS]  # peak memory of each loop
            for rep, (label, variants) in enumerate(jobs):
                runs = measure(workload, backend, variants, args, failures)
                for i, r in enumerate(runs):
                    r["repeat"], r["round"] = rep, (rep, i // n)
                    print(
                        f"  {workload:<13}{backend:<6}{label:<9} {r['variant']:<25}"
                        f"{r['samples_per_s']:>10.0f} samples/s ({r['elapsed_s']:.2f} s timed, "
                        f"launch {r['launch_wall_s']:.1f} s, others used "
                        f"{r['foreign_cores']:.2f} cores)",
                        flush=True,
                    )
                results += runs
    overhead = None
    if args.overhead_rounds > 0:
        overhead = run_overhead(args.overhead_rounds, args.timeout)
    print()
    rows = summarize(results, args.max_foreign)
    print(
        f"results: {args.nproc} processes, medians over the runs (of {args.repeats * args.rounds}) "
        "during "
        f"which other processes used <= {args.max_foreign} cores (all runs if fewer than 3)"
    )
    print_results(rows)
    print()
    foreign = statistics.median(r["foreign_cores"] for r in results) if results else 0.0
    busy = sum(1 for r in results if r["foreign_cores"] > args.max_foreign)
    print(
        f"other processes' CPU use during the runs: median {foreign:.2f} cores; {busy} of "
        f"{len(results)} kept runs above {args.max_foreign} cores even after "
        f"{args.retries} retries"
    )
    if busy:
        print("WARNING: the machine was not idle; throughput numbers are noisy.")
    bad = [r for r in results if r["exit_status"] != 0]
    if bad:
        print(f"WARNING: {len(bad)} launch(es) reported a result, then exited abnormally:")
        for r in bad:
            print(f"  {r['workload']} {r['variant']}: exit {r['exit_status']} {r['exit_note']}")
    print()
    checks = targets(rows, imports, args.nproc)
    if checks:
        width = max(len(t) for t, _, _, _ in checks) + 2
        print(f"{'target':<{width}}{'measured':<40}{'goal':<10}result")
        for target, measured, goal, passed in checks:
            print(f"{target:<{width}}{measured:<40}{goal:<10}{'PASS' if passed else 'MISS'}")
    if overhead:
        print("\n" + overhead["report"])
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {
            "machine": info,
            "imports": imports,
            "overhead": overhead,
            "runs": results,
            "rows": rows,
        }
        args.json.write_text(json.dumps(payload, indent=1))
    if failures:
        sys.exit(f"{len(failures)} launch(es) failed")


if __name__ == "__main__":
    main()
