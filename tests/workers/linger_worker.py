"""Two plain processes (no torchrun), rank 0 hosting the rendezvous store: rank 0 ends right
after ``train()``, rank 1 lingers a second first (a user's post-processing), then stops the
hang watcher as its exit does and prints whether the watcher thread still runs.

Usage: ``linger_worker.py RANK PORT``
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import fastdist
from fastdist import CrossEntropyLoss, DistTrainer
from fastdist.distributed import hang


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.linear(x)}


def main() -> None:
    rank, port = int(sys.argv[1]), sys.argv[2]
    fastdist.init_distributed(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    data = [(x[i], int(x[i].sum() > 0)) for i in range(32)]
    DistTrainer(
        data, Net(), loss=CrossEntropyLoss(), batch_size_per_gpu=4, device="cpu", use_tqdm=False
    ).train()
    if rank == 1:
        time.sleep(1)  # rank 0 and its store are gone meanwhile
        hang.stop()
        watcher = hang._watch.thread if hang._watch is not None else None
        print(f"watcher running: {watcher is not None and watcher.is_alive()}", flush=True)


if __name__ == "__main__":
    main()
