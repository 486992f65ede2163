"""Rank 0's memory during ``fastdist.predict`` against the size of its final output.

    python benchmarks/predict_memory.py [--n 200000] [--nproc 1,2]

For every world size the driver launches one torchrun job (``OMP_NUM_THREADS=1``); every
rank builds the same MLP 32-256-10 and the same ``n`` x 32 inputs, then calls ``predict``
twice: first with ``output_path`` (rank 0 streams one JSON line of 10 logits per sample to a
file), then returning the list (rank 0 gets ``n`` lists of 10 floats).

Measured on rank 0 around each call: the RSS growth ``peak - before``, where ``before`` is
``VmRSS`` just before the call and ``peak`` is ``VmHWM`` after it, the high-water mark having
been reset with ``/proc/self/clear_refs`` (a 5 ms sampling thread where that is refused).
Compared with ``final output + model``: the output is the returned list's deep in-memory size
(``sys.getsizeof`` summed over the list, the inner lists and the floats) or, with
``output_path``, the JSONL file's size; the model is its parameter bytes. The issue's target:
growth <= 1.2 x (output + model). Absolute figures (``ru_maxrss``) and the RSS of an idle
``python -c "import torch"`` are printed too. As a reference for what CPython itself needs to
hold such a list, rank 0 finally builds the same outputs with a plain loop (``hand``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from common import child_env, run_job

WORKER_ENV = "FASTDIST_PREDICT_BENCH_WORKER"
RESULT_PREFIX = "PREDICT_BENCH_RESULT "
MiB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000, help="samples to predict")
    parser.add_argument("--nproc", default="1,2", help="comma-separated world sizes")
    parser.add_argument("--batch-size", type=int, default=256, help="batch_size_per_gpu")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    return parser.parse_args()


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@contextmanager
def peak_rss() -> Iterator[dict[str, Any]]:
    """Measure ``{"before", "peak"}`` RSS in bytes over the block (see the module docstring)."""
    gc.collect()
    out: dict[str, Any] = {}
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        out["method"] = "VmHWM after clear_refs"
        sampler = None
    except OSError:
        out["method"] = "5 ms VmRSS sampling"
        stop = threading.Event()
        seen = [0]

        def sample() -> None:
            while not stop.wait(0.005):
                seen[0] = max(seen[0], status_kib("VmRSS"))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
    out["before"] = status_kib("VmRSS") * 1024
    try:
        yield out
    finally:
        if sampler is None:
            out["peak"] = status_kib("VmHWM") * 1024
        else:
            stop.set()
            sampler.join()
            out["peak"] = max(seen[0], status_kib("VmRSS")) * 1024


def deep_size(obj: Any) -> int:
    """``sys.getsizeof`` of ``obj`` plus, recursively, of the items of lists, tuples, dicts."""
    size = sys.getsizeof(obj)
    if isinstance(obj, (list, tuple)):
        size += sum(deep_size(item) for item in obj)
    elif isinstance(obj, dict):
        size += sum(deep_size(k) + deep_size(v) for k, v in obj.items())
    return size


# ----------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """One rank: predict to a file, then to a list; rank 0 prints its measurements as JSON."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from fastdist.distributed import (
        all_gather_object,
        barrier,
        get_rank,
        get_world_size,
        init_distributed,
    )
    from fastdist.evaluation.predict import predict

    torch.set_num_threads(1)
    init_distributed(backend="gloo")
    rank, world = get_rank(), get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    data = TensorDataset(torch.randn(args.n, 32))
    out: dict[str, Any] = {"world": world, "n": args.n, "model_bytes": model_bytes}
    out["start_rss"] = status_kib("VmRSS") * 1024  # torch, fastdist, gloo, data, model
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pred.jsonl")
        for mode in ("file", "list"):
            barrier()
            start = time.perf_counter()
            with peak_rss() as mem:
                result = predict(
                    model,
                    data,
                    batch_size_per_gpu=args.batch_size,
                    output_path=path if mode == "file" else None,
                )
            mem["seconds"] = time.perf_counter() - start
            if rank == 0:
                if mode == "file":
                    mem["output_bytes"] = os.path.getsize(path)
                    with open(path) as f:
                        mem["lines"] = sum(1 for _ in f)
                else:
                    assert result is not None and len(result) == args.n
                    mem["output_bytes"] = deep_size(result)
                    mem["lines"] = len(result)
            del result
            mem["all_growth"] = all_gather_object(mem["peak"] - mem["before"])
            out[mode] = mem
    if rank == 0:  # reference: the same outputs built by hand in this process, no fastdist
        with peak_rss() as mem, torch.no_grad():
            start = time.perf_counter()
            model.eval()
            hand: list[Any] = []
            for i in range(0, args.n, args.batch_size):
                hand.extend(model(data.tensors[0][i : i + args.batch_size]).tolist())
        mem["seconds"] = time.perf_counter() - start
        mem["output_bytes"] = deep_size(hand)
        mem["all_growth"] = [mem["peak"] - mem["before"]]
        del hand
        out["hand"] = mem
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- driver


def idle_rss(code: str) -> int:
    """VmRSS in bytes of a fresh ``python -c`` that ran ``code``."""
    probe = f"{code}\nprint(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=child_env({}),
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1]) * 1024


def launch(args: argparse.Namespace, nproc: int) -> dict[str, Any]:
    """One torchrun job of ``nproc`` workers; rank 0's result."""
    env = child_env({WORKER_ENV: json.dumps(vars(args))})
    return run_job(__file__, nproc, env, RESULT_PREFIX, args.timeout)


def main() -> None:
    if WORKER_ENV in os.environ:
        worker(argparse.Namespace(**json.loads(os.environ[WORKER_ENV])))
        return
    args = parse_args()
    mib: Callable[[float], str] = lambda b: f"{b / MiB:.1f}"  # noqa: E731
    bare = idle_rss("import torch")
    full = idle_rss("import torch, fastdist.evaluation.predict")
    print(f"idle RSS: python + import torch {mib(bare)} MiB; + fastdist {mib(full)} MiB")
    print(
        f"{args.n} samples x 32 -> MLP 32-256-10 -> 10 logits per sample, "
        f"batch_size_per_gpu {args.batch_size}, OMP_NUM_THREADS=1"
    )
    header = (
        f"{'world':>5} {'mode':>4} {'output MiB':>10} {'model MiB':>9} {'growth MiB':>10} "
        f"{'growth/(out+model)':>18} {'target':>6} {'other ranks MiB':>15} {'s':>6}"
    )
    rows = []
    for nproc in (int(v) for v in args.nproc.split(",")):
        r = launch(args, nproc)
        for mode in ("file", "list", "hand"):
            m = r[mode]
            growth = m["peak"] - m["before"]
            budget = m["output_bytes"] + r["model_bytes"]
            ratio = growth / budget
            others = " ".join(mib(g) for g in m["all_growth"][1:]) or "-"
            rows.append(
                f"{r['world']:>5} {mode:>4} {mib(m['output_bytes']):>10} "
                f"{mib(r['model_bytes']):>9} {mib(growth):>10} {ratio:>18.3f} "
                f"{'PASS' if ratio <= 1.2 else 'MISS':>6} {others:>15} {m['seconds']:>6.2f}"
            )
        rows.append(
            f"      world {r['world']}: rank 0 RSS at start {mib(r['start_rss'])} MiB, before "
            f"file/list {mib(r['file']['before'])}/{mib(r['list']['before'])} MiB, peak "
            f"file/list {mib(r['file']['peak'])}/{mib(r['list']['peak'])} MiB, ru_maxrss "
            f"{mib(r['ru_maxrss'])} MiB ({r['file']['method']})"
        )
    print(header)
    print("\n".join(rows))
    print(
        "growth = rank 0's peak RSS during predict - its RSS just before; output = JSONL file "
        "size (file) or the returned list's deep sys.getsizeof (list); target growth <= 1.2 x "
        "(output + model); hand = reference, the same list built by a plain loop "
        "(model(x).tolist()) on rank 0 without fastdist, run after the two predict calls"
    )


if __name__ == "__main__":
    main()
