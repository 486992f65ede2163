"""Cost of a fastdist checkpoint against one plain ``torch.save`` of the same payload.

    python benchmarks/checkpoint.py [--params 100e6] [--repeats 3] [--dir /tmp]

The payload is what ``DistTrainer`` writes: the model's and SGD-with-momentum's state. fastdist
writes a temp file, reads its CRC-32 back from the page cache, fsyncs, renames and updates the
manifest; the target is about one serialisation's time, i.e. no extra copy of the tensors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

from fastdist.checkpoint.files import CheckpointDir


def payload(n_params: float) -> dict:
    width = 4096
    layers = max(1, round(n_params / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the momentum buffers
    count = sum(p.numel() for p in model.parameters())
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "params": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    state = payload(args.params)
    n = state.pop("params")
    plain, fastdist_ = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        checkpoints = CheckpointDir(os.path.join(tmp, "checkpoints"), keep=1)
        for step in range(args.repeats):  # alternate the two, same payload, same disk state
            plain_file = os.path.join(tmp, f"plain-{step}.pt")
            os.sync()  # no dirty pages of the previous write left to slow this one
            start = time.perf_counter()
            with open(plain_file, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            plain.append(time.perf_counter() - start)
            size = os.path.getsize(plain_file)
            os.remove(plain_file)
            os.sync()
            start = time.perf_counter()
            checkpoints.save(state, step)  # also prunes the previous one (keep=1)
            fastdist_.append(time.perf_counter() - start)
    p, f = statistics.median(plain), statistics.median(fastdist_)
    print(f"model {n / 1e6:.0f}M parameters + momentum: {size / 2**20:.0f} MiB per checkpoint")
    print(f"torch.save + fsync (median of {args.repeats}): {p:.2f} s")
    print(f"fastdist checkpoint (write, CRC-32, fsync, rename, manifest): {f:.2f} s")
    print(f"ratio fastdist / plain: {f / p:.2f}")


if __name__ == "__main__":
    main()
