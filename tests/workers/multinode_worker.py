"""Train a tiny model and save the result: ``multinode_worker.py OUT_FILE [SAVE_PATH]``.

Launched as one node with 2 processes, as two single-process "nodes", or by a simulated
``srun``; every layout must end with the same parameters.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset
from workers.ending import exit_now

import fastdist
from fastdist import DistTrainer, logger


def main(out_file: str, save_path: str | None) -> None:
    fastdist.set_seed(0)
    x = torch.randn(64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = nn.Linear(4, 1).double()
    trainer = DistTrainer(
        data,
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        loss=nn.MSELoss(),
        batch_size_per_gpu=4,
        n_epochs=2,
        use_tqdm=False,
        save_path=save_path,
    )
    trainer.train()
    logger.warning("finished on this rank")
    if fastdist.get_rank() == 0:
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        with open(out_file, "w") as f:
            json.dump(params, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    exit_now()
