"""Worker for tests/test_topology.py: the layout's answers and the data each rank trains on.

Usage::

    topology_worker.py tp OUT_DIR      # torchrun, 2 ranks: FSDP(tp=2), one data shard
    topology_worker.py one OUT_DIR     # one process: the same runs on the plain model
    topology_worker.py hsdp OUT_DIR    # torchrun, 4 ranks: FSDP(replicate=2) and DDP
    topology_worker.py hsdp_tp OUT_DIR # torchrun, 8 ranks: FSDP(replicate=2, tp=2)

Every run trains tests/workers/fsdp_worker.py's BlockNet with AdamW and update_every=2 on a
global batch of 8 samples (or token batches of 8 samples); the parameters are compared with
one process's. Writes ``OUT_DIR/<mode>/rank<R>.json``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import IterableDataset
from workers.ending import exit_now
from workers.fsdp_worker import BlockNet
from workers.trainer_worker import ToyData, refused, write_json

from fastdist import Callback, CrossEntropyLoss, DistTrainer, get_rank, get_world_size
from fastdist.data import ShardedStream, TokenBatchSampler
from fastdist.strategies import DDP, FSDP, Topology
from fastdist.strategies.topology import _MESHES

PLAN = {"blocks.0": "colwise", "blocks.1": "rowwise"}
N_TRAIN, GLOBAL_BATCH = 40, 8
EQUAL = [1] * N_TRAIN  # every token batch holds 8 samples
VARIABLE = [1 + i % 4 for i in range(N_TRAIN)]  # token batches of 2 to 8 samples


class Steps(Callback):
    """What a callback reads of the layout, and the steps."""

    def on_train_begin(self) -> None:
        topology = self.trainer.topology
        shard = topology.data_shard
        self.seen = {"shard": [shard.rank, shard.size, shard.primary], "copies": topology.copies}


class Diverge(Callback):
    """Run on rank 0 only (callbacks_master): its copy of the first parameter (or of its
    shard) drifts after update 2, as code on one rank only would make it."""

    def on_step_end(self) -> None:
        if self.trainer.state.global_step == 2:
            first = next(self.trainer.model.parameters())
            with torch.no_grad():
                (first.to_local() if isinstance(first, DTensor) else first).add_(1.0)


def diverged(strategy: Any, **options: Any) -> str:
    """The error of a run whose rank 0 changes its copy of a parameter (``""``: none)."""
    try:
        train(strategy, callbacks_master=[Diverge()], **options)
    except RuntimeError as exc:
        return str(exc)
    return ""


class Part(IterableDataset):
    """The items ``i`` with ``i % size == rank`` of a stream of ``N_TRAIN`` ToyData samples."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.data = rank, size, ToyData(N_TRAIN)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.rank, N_TRAIN, self.size):
            yield {"x": self.data.x[i], "target": self.data.target[i]}


def train(strategy: Any, data: Any = None, batch: int = GLOBAL_BATCH, **options: Any) -> dict:
    """Train 2 epochs; the parameters (rank 0), the steps and what a callback read."""
    model, steps = BlockNet(), Steps()
    trainer = DistTrainer(
        ToyData(N_TRAIN) if data is None else data,
        model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        loss=CrossEntropyLoss(),
        callbacks_all=[steps],
        batch_size_per_gpu=batch,
        update_every=2,
        n_epochs=2,
        print_every=10_000,
        use_tqdm=False,
        device="cpu",
        strategy=strategy,
        timeout=60,
        **options,
    )
    summary = trainer.train()
    full = trainer.strategy.full_state_dict()
    params = None
    if full is not None:
        plain = BlockNet()
        plain.load_state_dict(full)
        params = torch.cat([p.detach().flatten() for p in plain.parameters()]).tolist()
    return {"steps": summary["steps"], "params": params, **steps.seen}


def tokens(lengths: list[int], strategy: Any) -> dict[str, Any]:
    sampler = TokenBatchSampler(lengths, max_tokens=GLOBAL_BATCH, seed=3)
    return train(strategy, batch_sampler=sampler)


def tensor_parallel(strategy: Any) -> dict[str, Any]:
    """Token batches and a sharded stream, each on the data shard the topology names."""
    shard = Topology.of(strategy).data_shard
    own = ShardedStream(Part(shard.rank, shard.size), shard.rank, shard.size)
    by_rank = ShardedStream(Part(get_rank(), get_world_size()), get_rank(), get_world_size())
    return {
        "equal": tokens(EQUAL, strategy),
        "variable": tokens(VARIABLE, strategy),
        "stream": train(strategy, own),
        "stream_by_rank": refused(lambda: train(strategy, by_rank)),
        "stream_unsaid": refused(lambda: train(strategy, ShardedStream(Part(0, 1)))),
    }


def main(argv: list[str]) -> int:
    mode, out = argv[1], Path(argv[2]) / argv[1]
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    if mode == "one":
        result = tensor_parallel(DDP())
        result["plain"] = train("ddp")
    elif mode == "tp":
        result = tensor_parallel(FSDP(tp=2, tp_plan=PLAN))
        result["diverged"] = diverged(FSDP(tp=2, tp_plan=PLAN))  # an unplanned layer: copies
    elif mode == "hsdp":
        result["bad"] = refused(lambda: train(FSDP(replicate=3)))
        result["meshes_made"] = len(_MESHES)
        result["hsdp"] = train(FSDP(replicate=2), batch=2, check_sync_every=1)
        result["ddp"] = train("ddp", batch=2, check_sync_every=1)
        result["diverged"] = diverged(FSDP(replicate=2), batch=2, check_sync_every=1)
    else:
        result["hsdp_tp"] = train(FSDP(replicate=2, tp=2, tp_plan=PLAN), batch=2)
    write_json(out, result)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv))
