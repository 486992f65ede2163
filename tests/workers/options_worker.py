"""Train the same small task with each precision / communication option: ``options_worker.py OUT``.

Every variant runs in the same process group, one after the other; rank 0 writes the dev
accuracy and the final parameters of each to ``OUT/options.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset
from workers.ending import exit_now

import fastdist
from fastdist import DDP, AccuracyMetric, DistTrainer

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"amp": "bf16"},
    "hook_fp16": {"strategy": DDP(comm_hook="fp16")},
    "hook_powersgd": {"strategy": DDP(comm_hook="powersgd")},
    # Checked every 3 updates: the replicas agree at 3 and 12, not at 6 or 9 (no false error).
    "average_every_4": {"strategy": DDP(average_every=4), "check_sync_every": 3},
    "ddp_knobs": {
        "strategy": DDP(static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=1)
    },
}


def train(options: dict[str, Any]) -> dict[str, Any]:
    fastdist.set_seed(0)
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
    trainer = DistTrainer(
        data,
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        loss=nn.CrossEntropyLoss(),
        dev_data=data,
        metrics=AccuracyMetric(),
        n_epochs=4,
        batch_size_per_gpu=16,
        use_tqdm=False,
        load_best_model=False,
        **{"check_sync_every": 4, **options},  # the replicas must agree
    )
    result = trainer.train()
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return {"acc": result["best_eval"]["acc"], "params": params}


if __name__ == "__main__":
    results = {name: train(options) for name, options in VARIANTS.items()}
    if fastdist.get_rank() == 0:
        (Path(sys.argv[1]) / "options.json").write_text(json.dumps(results))
    exit_now()
